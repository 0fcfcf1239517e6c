"""What this trainer does with each public call of the pinned ``tinker`` SDK's clients, kept as data (``CALLS``, one
entry per method, an ``_async`` twin folded onto its name), and the Markdown table ``docs/tinker.md`` carries between
its markers, generated from it.

A call is *served* (the test in ``tests/`` that drives it through the SDK is named), *refused* (the route the SDK
calls answers 404 with a reason: the server's own, ``routes/service.py``'s ``UNSERVED``), *client-side* (the SDK
answers it alone: nothing here to serve) or *absent* (it needs what this server does not have).
``tests/unit/test_sdk_compatibility.py`` fails when the SDK has a call ``CALLS`` does not cover, when ``CALLS`` names
one the SDK lacks, or when the page's table is not the one generated here; rewrite it with
``.venv/bin/python -m tests.support.sdk_compatibility --write``.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import tinker

from tests.support.running import REPO
from tinker_atropos.tinker_api.http.routes.service import UNSERVED

CLIENTS: tuple[type, ...] = (
    tinker.ServiceClient,
    tinker.TrainingClient,
    tinker.SamplingClient,
    tinker.RestClient,
)
PAGE = REPO / "docs" / "tinker.md"
START, END = "<!-- sdk-compatibility:start -->", "<!-- sdk-compatibility:end -->"
REGENERATE = ".venv/bin/python -m tests.support.sdk_compatibility --write"

Verdict = Literal["served", "refused", "client-side", "absent"]


@dataclass(frozen=True)
class Call:
    verdict: Verdict
    note: str = ""
    route: str = ""  # served: the routes it takes; refused: "METHOD /api/v1/path", a key of UNSERVED
    tests: tuple[str, ...] = ()  # served: "tests/<file>.py::<test function>" that drive it through the SDK


def served(route: str, *tests: str, note: str = "") -> Call:
    return Call("served", note, route, tests)


def refused(route: str, note: str = "") -> Call:
    return Call("refused", note, route)


def client_side(note: str) -> Call:
    return Call("client-side", note)


API = "tests/services/test_tinker_api.py::"
SDK_CALLS = "tests/services/test_tinker_sdk_calls.py::"
SAMPLES = API + "test_the_tiny_lm_samples_through_both_kinds_of_sampling_client"
REST = API + "test_training_runs_and_checkpoints_through_the_rest_client"
SMALLER = SDK_CALLS + "test_the_smaller_calls_of_the_training_sampling_and_rest_clients"
SAVED_STATE = API + "test_saved_state_with_optimizer_continues_identically"
TELEMETRY = client_side("the SDK's own telemetry; what it posts to `telemetry` is accepted and dropped")
CONSOLE = client_side("a link to the hosted Tinker console, which knows nothing of this server")
TOKENIZER = client_side(
    "loads the tokenizer from the Hugging Face hub by the base model's name: SmolLM2's where the hub is reachable; "
    "the tiny LM's is `tinker_atropos.models.tiny_lm.ByteTokenizer`"
)

CALLS: dict[str, Call] = {
    "ServiceClient.close": served(
        "`sessions/{id}/finish`",
        API + "test_closing_the_service_client_finishes_its_session",
        API + "test_a_finished_sessions_model_refuses_further_requests",
        note="its models unloaded; a session that stops its heartbeat is finished too",
    ),
    "ServiceClient.copy_weights": refused("POST /api/v1/copy_weights"),
    "ServiceClient.create_custom_loss": served(
        "",
        SMALLER,
        note="the SDK traces the loss and runs it client-side over `cross_entropy` "
        "(`client/config`: `custom_loss_server_side` off)",
    ),
    "ServiceClient.create_lora_training_client": served(
        "`create_session`, `create_model`, `get_info`",
        API + "test_ppo_steps_lower_the_loss_on_fixed_data",
        note="LMs: LoRA of the rank asked, or `rank=0` for every parameter; control policies train fully; "
        "`user_metadata` kept (the cookbook saves its renderer there)",
    ),
    "ServiceClient.create_rest_client": served("", SMALLER, note="a `RestClient` of the same key"),
    "ServiceClient.create_sampling_client": served(
        "`create_sampling_session`",
        SAMPLES,
        note="LMs; with `record_stability_info` each sequence is recorded "
        "under its `sequence_id`, a day, for `stable_reinforce`",
    ),
    "ServiceClient.create_training_client_from_state": served(
        "`create_model`, `load_weights`", SAVED_STATE, REST
    ),
    "ServiceClient.create_training_client_from_state_with_optimizer": served(
        "`create_model`, `load_weights`", SAVED_STATE
    ),
    "ServiceClient.get_console_url": CONSOLE,
    "ServiceClient.get_server_capabilities": served(
        "`get_server_capabilities`", API + "test_capabilities_list_the_run_policy_and_the_language_models"
    ),
    "ServiceClient.get_telemetry": TELEMETRY,
    "TrainingClient.create_sampling_client": served("`create_sampling_session`", SMALLER),
    "TrainingClient.forward": served("`forward_backward` (forward only), `retrieve_future`", SMALLER),
    "TrainingClient.forward_backward": served(
        "`forward_backward` (Protobuf), `retrieve_future`",
        SMALLER,
        API + "test_cispo_dro_and_gspo_are_served_as_tinkers_pages_define_them",
        note="`cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `dro`, `gspo` (the cookbook's `rl_loop` "
        "sends it `sequence_ratio_mask`), `stable_reinforce` (the cookbook's RL default) with provenance spans",
    ),
    "TrainingClient.forward_backward_custom": served(
        "`forward_backward`",
        API + "test_a_custom_loss_runs_client_side_over_the_servers_cross_entropy",
        note="the SDK runs the loss client-side over `cross_entropy`",
    ),
    "TrainingClient.get_console_url": CONSOLE,
    "TrainingClient.get_info": served("`get_info`", SAMPLES),
    "TrainingClient.get_telemetry": TELEMETRY,
    "TrainingClient.get_tokenizer": TOKENIZER,
    "TrainingClient.load_state": served("`load_weights`", SMALLER),
    "TrainingClient.load_state_with_optimizer": served("`load_weights`", SMALLER),
    "TrainingClient.optim_step": served("`optim_step`", SMALLER, note="AdamW; Dimuon refused"),
    "TrainingClient.save_state": served(
        "`save_weights`",
        SAVED_STATE,
        REST,
        note="`tinker://<model>/weights/<name>`; a checkpoint whose `ttl_seconds` ran out is deleted within a "
        "second, files too",
    ),
    "TrainingClient.save_weights_and_get_sampling_client": served(
        "`save_weights_for_sampler`, `create_sampling_session`",
        SAMPLES,
        note="its unnamed weights deleted once unused for `trainer.tinker.ephemeral_weights_ttl_s`",
    ),
    "TrainingClient.save_weights_external": served(
        "`save_weights_external`",
        "tests/services/test_tinker_weights_out.py::"
        "test_smollm2_lora_leaves_as_a_peft_adapter_and_merged_with_the_servers_logprobs",
        note="transformers-based LMs: a PEFT adapter or merged folder on the trainer's disk (Weights out, below), "
        "listed, deleted and expired as the other checkpoints; the tiny LM and control policies: the user's "
        "error; `age_encryption_recipients` refused",
    ),
    "TrainingClient.save_weights_for_sampler": served(
        "`save_weights_for_sampler`", REST, note="`ttl_seconds` and `user_metadata` kept"
    ),
    "SamplingClient.compute_logprobs": served("`asample`", SAMPLES),
    "SamplingClient.create": served("`create_sampling_session`", SMALLER, note="what the other clients call"),
    "SamplingClient.from_sampler_handle": served("`asample`", SMALLER),
    "SamplingClient.get_base_model": served("", SMALLER, note="known since the client was made"),
    "SamplingClient.get_sampler_handle": served("", SMALLER),
    "SamplingClient.get_telemetry": TELEMETRY,
    "SamplingClient.get_tokenizer": TOKENIZER,
    "SamplingClient.on_queue_state_change": client_side(
        "the SDK's hook for a queued request's state; this server reports every request active"
    ),
    "SamplingClient.sample": served(
        "`asample`, `retrieve_future`",
        SAMPLES,
        SDK_CALLS + "test_top_k_log_probs_are_the_served_models_own_at_every_position",
        SDK_CALLS + "test_log_prob_options_out_of_range_are_refused_naming_the_field",
        note="LMs: temperature, top-k, top-p, seed, stop tokens and strings; prompt log-probs, top-k prompt and "
        "sampled-token log-probs (k up to 20), `prompt_logprobs_last_n`, `record_stability_info`; "
        "`target_prompt_logprobs` and `prompt_alt_tokens_k` refused (400)",
    ),
    "RestClient.assign_session_project": refused("PUT /api/v1/sessions/{session_id}/project"),
    "RestClient.copy_weights": refused("POST /api/v1/copy_weights"),
    "RestClient.delete_checkpoint": served(
        "`DELETE training_runs/{id}/checkpoints/{kind}/{name}`", SMALLER, note="the files too"
    ),
    "RestClient.delete_checkpoint_from_tinker_path": served(
        "`DELETE training_runs/{id}/checkpoints/{kind}/{name}`",
        REST,
        note="the files too (the cookbook's rolling checkpoints)",
    ),
    "RestClient.export_session_trace": refused("GET /api/v1/sessions/{session_id}/trace_export"),
    "RestClient.get_audit_log": refused("GET /api/v1/audit"),
    "RestClient.get_billing_usage": refused("GET /api/v1/billing/usage/events"),
    "RestClient.get_current_checkpoint_storage_usage": refused(
        "GET /api/v1/billing/usage/checkpoints/current"
    ),
    "RestClient.get_external_weights_urls": refused(
        "GET /api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls",
        note="so `tinker checkpoint download` too",
    ),
    "RestClient.get_sampler": served("`GET samplers/{id}`", SMALLER),
    "RestClient.get_server_capabilities": served(
        "`GET get_server_capabilities`", API + "test_capabilities_list_the_run_policy_and_the_language_models"
    ),
    "RestClient.get_session": refused("GET /api/v1/sessions/{session_id}"),
    "RestClient.get_telemetry": TELEMETRY,
    "RestClient.get_training_run": served("`GET training_runs/{id}`", REST),
    "RestClient.get_training_run_by_tinker_path": served(
        "`GET training_runs/{id}`", REST, note="the cookbook's resume, `load_checkpoint_path` and evals"
    ),
    "RestClient.get_weights_info_by_tinker_path": served("`weights_info`", REST),
    "RestClient.list_checkpoints": served(
        "`GET training_runs/{id}/checkpoints`", REST, note="checkpoints saved under a name"
    ),
    "RestClient.list_sessions": refused("GET /api/v1/sessions"),
    "RestClient.list_training_runs": served("`GET training_runs`", REST),
    "RestClient.list_user_checkpoints": served("`GET checkpoints`", REST),
    "RestClient.publish_checkpoint_from_tinker_path": served(
        "`POST …/publish`",
        REST,
        note="409 when already public, as the SDK documents; every key of this server "
        "reads every checkpoint, so public is a flag the listings show",
    ),
    "RestClient.search_sessions": refused("POST /api/v1/sessions/search"),
    "RestClient.set_checkpoint_ttl_from_tinker_path": served("`PUT …/ttl`", REST),
    "RestClient.unpublish_checkpoint_from_tinker_path": served("`DELETE …/publish`", REST),
    "RestClient.whoami": Call(
        "absent",
        "reads the JWT of the SDK's auth exchange; this server has no JWT auth (`client/config`), so "
        "the SDK raises that whoami needs it",
    ),
}


def sdk_calls() -> dict[str, Callable]:
    """Every public method of ``CLIENTS`` by ``Client.name``, an ``_async`` twin folded onto its sync name (its
    property ``holder`` is no call)."""
    found: dict[str, Callable] = {}
    for client in CLIENTS:
        names = {n for n in dir(client) if not n.startswith("_")}
        for name in sorted(names):
            attribute = inspect.getattr_static(client, name)
            function = attribute.__func__ if isinstance(attribute, staticmethod | classmethod) else attribute
            if not inspect.isfunction(function):
                continue
            if name.endswith("_async") and name.removesuffix("_async") in names:
                continue
            found[f"{client.__name__}.{name}"] = function
    return found


def coverage_problems(sdk: set[str], calls: dict[str, Call]) -> list[str]:
    """Why ``calls`` does not cover ``sdk`` one to one, a line each (none when it does)."""
    return [f"{name}: the SDK has it, CALLS does not" for name in sorted(sdk - set(calls))] + [
        f"{name}: in CALLS, not in the SDK" for name in sorted(set(calls) - sdk)
    ]


@cache
def sources(path: str) -> dict[str, str]:
    """The source of each test function at the top of a test file, by name ({} for no such file)."""
    if not (REPO / path).is_file():
        return {}
    text = (REPO / path).read_text()
    return {
        node.name: ast.get_source_segment(text, node) or ""
        for node in ast.parse(text).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def unexercised(calls: dict[str, Call]) -> list[str]:
    """The served calls that name no test, a test that is not in its file, or only tests that never name them
    (as an attribute: ``.sample``)."""
    problems = []
    for name, call in calls.items():
        found = {test: sources(test.partition("::")[0]).get(test.partition("::")[2]) for test in call.tests}
        problems += [f"{name}: no test {test}" for test, source in found.items() if source is None]
        used = re.compile(rf"\.{name.split('.')[1]}\b")
        if call.verdict == "served" and not any(used.search(source or "") for source in found.values()):
            problems.append(f"{name}: served, but none of the tests it names uses it")
    return problems


def refusal(call: Call) -> tuple[str, str, str]:
    """A refused call's route as (method, path) and the reason the server gives."""
    method, path = call.route.split(" ", 1)
    return method, path, UNSERVED[(method, path)]


def _cells(name: str, call: Call, function: Callable) -> list[str]:
    client, method = name.split(".")
    twin = "[_async]" if hasattr(getattr(tinker, client), f"{method}_async") else ""
    marked = getattr(function, "__deprecated__", None) or ""
    sdk_note = "experimental" if "experimental" in marked else "deprecated" if marked else ""
    note = call.note
    route = call.route or "—"
    if call.verdict == "refused":
        method_, path, reason = refusal(call)
        route = f"`{method_} {path.removeprefix('/api/v1/')}`"
        reason = reason.replace("<", "&lt;").replace(">", "&gt;")  # the server's text, not HTML
        note = f"404: {reason}" + (f"; {call.note}" if call.note else "")
    tests = ", ".join(f"`{t.partition('::')[2]}`" for t in call.tests)
    shown = f"`{name}{twin}`" + (f" ({sdk_note} in the SDK)" if sdk_note else "")
    return [cell.replace("|", "\\|") for cell in (shown, route, call.verdict, note, tests)]


def table(calls: dict[str, Call] = CALLS) -> str:
    """The Markdown table of every SDK call, in ``CLIENTS``' order and by name within each."""
    functions = sdk_calls()
    order = {client.__name__: i for i, client in enumerate(CLIENTS)}
    rows = ["| call | route | verdict | notes | tested by |", "|---|---|---|---|---|"]
    for name in sorted(calls, key=lambda n: (order[n.split(".")[0]], n)):
        rows.append("| " + " | ".join(_cells(name, calls[name], functions[name])) + " |")
    return "\n".join(rows) + "\n"


def block(text: str) -> str:
    """What lies between the page's markers (ValueError when they are not there, once each, in order)."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{PAGE.relative_to(REPO)} needs {START} and {END} once each, in that order")
    return text.split(START)[1].split(END)[0]


def write(page: Path = PAGE) -> None:
    """Rewrite the table between the page's markers."""
    text = page.read_text()
    page.write_text(text.replace(START + block(text) + END, f"{START}\n{table()}{END}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {PAGE.relative_to(REPO)}")
    if parser.parse_args().write:
        write()
        print(f"wrote the SDK compatibility table of {PAGE.relative_to(REPO)}")
    else:
        print(table(), end="")


if __name__ == "__main__":
    main()
