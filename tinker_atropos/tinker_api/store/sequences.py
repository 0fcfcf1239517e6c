"""What StableReinforce trains on besides the datum: the sampler's own record of each sequence it sampled.

A sampling client made with ``record_stability_info=True`` has every sequence it samples recorded here (its
prompt, its tokens and the log-probs the sampler gave them, the session that sampled it), under the
``sequence_id`` the SDK hands back, for a day that each training request using it restarts (as Tinker documents).
A ``stable_reinforce`` request names those sequences in each datum's provenance; ``look_up`` turns the spans into
the sampler's log-probs for the datum's sampled targets (``Datum.sampler_logprobs``), refusing a sequence of
another session, an unknown or expired one, a span past its end, or targets that are not the tokens it sampled.
"""

from __future__ import annotations

import json

import numpy as np

from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.store.namespace import Keys

# Tinker: "can be trained on for one day after sampling. Each training request that uses a sequence restarts that day."
SEQUENCE_TTL_S = 86_400


def sequence_ids(request_id: str, num_samples: int) -> list[str]:
    """The ids of a sample request's sequences: handed out when it is queued, recorded when it is done."""
    return [f"{request_id}:{i}" for i in range(num_samples)]


def session_of(resource_id: str) -> str:
    """The session a model or sampling session belongs to (its id's first part)."""
    return resource_id.split(":", 1)[0]


class Record(Keys):
    """The sequences samplers recorded, in the run's Tinker namespace (``sequence:<sequence_id>`` hashes)."""

    def add(self, request_id: str, body: bytes, response: bytes) -> None:
        """Record the sequences of a finished sample request, if it asked for ``record_stability_info``."""
        request = json.loads(body)
        if not request.get("record_stability_info"):
            return
        session = session_of(request.get("sampling_session_id") or "")
        prompt = np.asarray(wire.prompt_tokens(request), dtype=np.int32).tobytes()
        sequences = wire.read_sample_response(response)
        pipe = self.client.pipeline(transaction=False)
        for sequence_id, (tokens, logprobs) in zip(
            sequence_ids(request_id, len(sequences)), sequences, strict=True
        ):
            key = self._key("sequence", sequence_id)
            pipe.hset(
                key,
                mapping={
                    "session": session,
                    "prompt": prompt,
                    "tokens": tokens.tobytes(),
                    "logprobs": logprobs.tobytes(),
                },
            )
            pipe.expire(key, SEQUENCE_TTL_S)
        pipe.execute()

    def look_up(self, model_id: str, request: wire.ForwardBackward) -> None:
        """Set each datum's ``sampler_logprobs`` from its provenance; WireError for provenance that does not hold."""
        session = session_of(model_id)
        named = sorted({span.sequence_id for spans in request.provenance for span in spans or ()})
        pipe = self.client.pipeline(transaction=False)
        for sequence_id in named:
            pipe.hgetall(self._key("sequence", sequence_id))
            pipe.expire(self._key("sequence", sequence_id), SEQUENCE_TTL_S)
        replies = pipe.execute()
        records = {
            name: found
            for name, found in zip(named, replies[::2], strict=True)
            if found and found[b"session"].decode() == session
        }
        for index, (datum, spans) in enumerate(zip(request.data, request.provenance, strict=True)):
            if spans is None:
                raise wire.WireError(
                    f"datum {index}: stable_reinforce needs its provenance: sample with "
                    "record_stability_info=True and attach the spans (Datum.with_provenance)"
                )
            targets = datum.inputs.get("target_tokens")
            out, at = np.full(len(datum.tokens), np.nan, dtype=np.float32), 0
            for span in spans:
                found = records.get(span.sequence_id)
                if found is None:
                    raise wire.WireError(
                        f"datum {index}: no recorded sequence {span.sequence_id!r} in this session "
                        f"(sampled elsewhere, without record_stability_info, or over "
                        f"{SEQUENCE_TTL_S // 3600} h unused)"
                    )
                source = np.frombuffer(found[b"tokens" if span.sampled else b"prompt"], dtype=np.int32)
                end = span.offset + span.length
                if end > len(source):
                    raise wire.WireError(
                        f"datum {index}: a span names positions {span.offset} to {end - 1} of "
                        f"sequence {span.sequence_id!r}'s {'sampled tokens' if span.sampled else 'prompt'}"
                        f", which has {len(source)}"
                    )
                if span.sampled:
                    if targets is not None and not np.array_equal(
                        targets[at : at + span.length], source[span.offset : end]
                    ):
                        raise wire.WireError(
                            f"datum {index}: targets {at} to {at + span.length - 1} are not the "
                            f"tokens sequence {span.sequence_id!r} sampled"
                        )
                    out[at : at + span.length] = np.frombuffer(found[b"logprobs"], dtype=np.float32)[
                        span.offset : end
                    ]
                at += span.length
            datum.sampler_logprobs = out
