"""The SDK compatibility table (``tests/support/sdk_compatibility.py``, shown in ``docs/tinker.md``) covers every
public call of the pinned SDK's clients and nothing else, names a test that uses each call it says is served, names
for each refused call a route the API answers 404 with the reason the table shows (the API built in-process over a
stand-in store: a refused route touches none), and is the table the page carries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from tests.support import sdk_compatibility as compatibility
from tests.support.running import REPO
from tinker_atropos.tinker_api.http.app import build_app

FIX = f"edit CALLS in tests/support/sdk_compatibility.py, then run {compatibility.REGENERATE}"


def test_every_public_call_of_the_sdk_has_one_entry_and_nothing_else_has() -> None:
    calls = compatibility.sdk_calls()
    assert len(calls) > 50  # the walk saw the clients
    assert "SamplingClient.sample" in calls and "SamplingClient.sample_async" not in calls  # twins folded
    assert "ServiceClient.holder" not in calls  # a property, no call
    problems = compatibility.coverage_problems(set(calls), compatibility.CALLS)
    assert not problems, "\n".join([*problems, FIX])


def test_the_coverage_check_names_a_call_left_out_and_one_the_sdk_lacks() -> None:
    calls = dict(compatibility.CALLS)
    kept = calls.pop("SamplingClient.sample")
    calls["SamplingClient.sample_everything"] = kept
    assert compatibility.coverage_problems(set(compatibility.sdk_calls()), calls) == [
        "SamplingClient.sample: the SDK has it, CALLS does not",
        "SamplingClient.sample_everything: in CALLS, not in the SDK",
    ]


def test_each_served_call_names_tests_that_exist_and_use_it() -> None:
    problems = compatibility.unexercised(compatibility.CALLS)
    assert not problems, "\n".join([*problems, FIX])
    wrong = {
        "TrainingClient.get_info": compatibility.served("", "tests/services/test_tinker_api.py::test_none"),
        "SamplingClient.sample": compatibility.served("", compatibility.REST),  # a test that never samples
        "RestClient.get_sampler": compatibility.served(""),
    }
    assert compatibility.unexercised(wrong) == [
        "TrainingClient.get_info: no test tests/services/test_tinker_api.py::test_none",
        "TrainingClient.get_info: served, but none of the tests it names uses it",
        "SamplingClient.sample: served, but none of the tests it names uses it",
        "RestClient.get_sampler: served, but none of the tests it names uses it",
    ]


REFUSED = sorted((name, call) for name, call in compatibility.CALLS.items() if call.verdict == "refused")


@pytest.fixture(scope="module")
def api() -> TestClient:
    store = SimpleNamespace(requests=SimpleNamespace(finished=[]))
    return TestClient(build_app(store, api_keys=[], capabilities=[]))  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "call"), REFUSED, ids=[name for name, _ in REFUSED])
def test_each_refused_call_is_answered_404_with_the_reason_the_table_shows(
    api: TestClient, name: str, call: compatibility.Call
) -> None:
    method, path, reason = compatibility.refusal(call)
    answer = api.request(method, path.replace("{", "").replace("}", ""), json={})
    assert answer.status_code == 404 and answer.json() == {"detail": f"not served by this trainer: {reason}"}
    assert reason.replace("<", "&lt;").replace(">", "&gt;") in compatibility.table()


def test_the_page_carries_the_table_generated_from_the_entries() -> None:
    text = compatibility.PAGE.read_text()
    generated = compatibility.table()
    assert compatibility.block(text) == f"\n{generated}", (
        f"{compatibility.PAGE.relative_to(REPO)}'s SDK compatibility table is not the one generated from "
        f"tests/support/sdk_compatibility.py: run {compatibility.REGENERATE}"
    )
    with pytest.raises(ValueError, match="sdk-compatibility:start"):
        compatibility.block(text.replace(compatibility.START, ""))


def test_writing_the_table_replaces_only_what_lies_between_the_markers(tmp_path) -> None:
    page = tmp_path / "tinker.md"
    page.write_text(f"before\n{compatibility.START}\nstale | table\n{compatibility.END}\nafter\n")
    compatibility.write(page)
    assert page.read_text() == (
        f"before\n{compatibility.START}\n{compatibility.table()}{compatibility.END}\nafter\n"
    )
