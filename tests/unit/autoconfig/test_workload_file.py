"""JSONL workload files: parsing, the weighted mix, the errors that name line and key, and the stress client
sending their requests (behind ``httpx.MockTransport``)."""

import asyncio
import json
import re
from collections import Counter

import httpx
import pytest

from autoconfig.stress import ClientSettings, StressClient
from autoconfig.workloads import (
    CYCLE,
    HttpRequest,
    TemplateWorkload,
    Workload,
    WorkloadError,
    load_workload_file,
)

TWO_TEMPLATES = """\
# a comment, then a blank line

{"path": "/infer", "body": {"inputs": [1, 2]}, "weight": 3}
{"method": "get", "path": "/health?x=1", "headers": {"X-Trace": "on"}}
"""


def _write(tmp_path, text: str | bytes, name: str = "w.jsonl"):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_a_file_of_two_templates_gives_their_requests_with_defaults_and_json_bodies(tmp_path):
    workload = load_workload_file(_write(tmp_path, TWO_TEMPLATES))
    infer, health = workload.templates
    assert infer == HttpRequest("POST", "/infer", b'{"inputs": [1, 2]}', {"content-type": "application/json"})
    assert health == HttpRequest("GET", "/health?x=1", b"", {"X-Trace": "on"})  # no body: no content-type
    assert workload.weights == (3.0, 1.0)
    assert workload.request(0) in (infer, health) and workload.seed == 0


def test_body_kinds_are_sent_as_json_and_a_set_content_type_is_kept(tmp_path):
    lines = [
        {"path": "/a", "body": "plain words"},
        {"path": "/b", "body": [1, "x"]},
        {"path": "/c", "body": 2.5},
        {"path": "/d", "body": {"k": "v"}, "headers": {"Content-Type": "application/vnd.x+json"}},
        {"method": "Delete", "path": "/e", "body": None},
    ]
    workload = load_workload_file(_write(tmp_path, "\n".join(json.dumps(line) for line in lines)))
    bodies = [(t.method, t.body, dict(t.headers)) for t in workload.templates]
    json_type = {"content-type": "application/json"}
    assert bodies == [
        ("POST", b'"plain words"', json_type),  # a string is sent as a JSON string, quotes and all
        ("POST", b'[1, "x"]', json_type),
        ("POST", b"2.5", json_type),
        ("POST", b'{"k": "v"}', {"Content-Type": "application/vnd.x+json"}),
        ("DELETE", b"", {}),
    ]


def test_the_mix_follows_the_weights_and_is_deterministic_for_a_seed(tmp_path):
    path = _write(tmp_path, TWO_TEMPLATES)
    workload = load_workload_file(path)
    paths = [workload.request(i).path for i in range(4000)]
    share = Counter(paths)["/infer"] / len(paths)
    assert abs(share - 0.75) < 0.02
    cycle = Counter(workload.request(i).path for i in range(CYCLE))
    assert cycle == {"/infer": 3072, "/health?x=1": 1024}  # exact over one cycle
    assert "/health?x=1" in paths[:20] and "/infer" in paths[:20]  # shuffled, not in blocks
    assert paths == [load_workload_file(path).request(i).path for i in range(4000)]
    reseeded = [load_workload_file(path, seed=1).request(i).path for i in range(4000)]
    assert reseeded != paths and abs(Counter(reseeded)["/infer"] / 4000 - 0.75) < 0.02
    assert workload.request(CYCLE + 7) == workload.request(7)


def test_one_template_is_always_sent_and_a_tiny_weight_still_gets_a_slot():
    only = HttpRequest("POST", "/x", b"{}", {})
    single = TemplateWorkload((only,), (0.5,))
    assert all(single.request(i) is only for i in range(CYCLE + 3))
    rare = HttpRequest("GET", "/rare", b"", {})
    skewed = TemplateWorkload((only, rare), (1e9, 1.0))
    assert Counter(skewed.order) == {0: CYCLE, 1: 1}
    with pytest.raises(ValueError, match="weights"):
        TemplateWorkload((only,), (0.0,))
    with pytest.raises(ValueError, match="one weight for each"):
        TemplateWorkload((only, rare), (1.0,))


def test_workload_request_carries_its_route_and_the_indexed_body():
    workload = Workload("PUT", "/p", lambda index: str(index).encode(), {"a": "b"})
    assert workload.request(4) == HttpRequest("PUT", "/p", b"4", {"a": "b"})


GOOD = '{"path": "/ok"}'


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([GOOD, GOOD, "{not json"], r"w\.jsonl:3: not JSON \(Expecting property name"),
        ([GOOD, "NaN"], r"w\.jsonl:2: not JSON \(NaN is not valid JSON\)"),
        (["[1, 2]"], r"w\.jsonl:1: not a JSON object"),
        ([GOOD, '{"path": "ok"}'], r"w\.jsonl:2: 'path' must start with '/'"),
        ([GOOD, '{"path": 3}'], r"w\.jsonl:2: 'path' must start with '/'"),
        (['{"method": "GET"}'], r"w\.jsonl:1: missing key 'path'"),
        ([GOOD, GOOD, GOOD, '{"path": "/x", "bdy": {}}'],
         r"w\.jsonl:4: unknown key 'bdy'; keys: method, path, headers, body, weight"),
        (['{"path": "/x", "path": "/y"}'], r"w\.jsonl:1: not JSON \(duplicate key 'path'\)"),
        (['{"path": "/x", "method": "FETCH"}'], r"w\.jsonl:1: 'method' must be one of GET, POST, PUT, PATCH, DELETE"),
        (['{"path": "/x", "method": 1}'], r"w\.jsonl:1: 'method' must be one of"),
        ([GOOD, GOOD, GOOD, GOOD, '{"path": "/x", "weight": 0}'], r"w\.jsonl:5: 'weight' must be a number > 0"),
        (['{"path": "/x", "weight": -1}'], r"w\.jsonl:1: 'weight' must be a number > 0"),
        (['{"path": "/x", "weight": "2"}'], r"w\.jsonl:1: 'weight' must be a number > 0"),
        (['{"path": "/x", "weight": true}'], r"w\.jsonl:1: 'weight' must be a number > 0"),
        (['{"path": "/x", "weight": 1e999}'], r"w\.jsonl:1: 'weight' must be a number > 0"),
        (['{"path": "/x", "headers": ["a"]}'], r"w\.jsonl:1: 'headers' must be an object of strings"),
        (['{"path": "/x", "headers": {"a": 1}}'], r"w\.jsonl:1: 'headers': 'a' must be a string on one line"),
        (['{"path": "/x", "headers": {"a": "x\\r\\nb: y"}}'], r"w\.jsonl:1: 'headers': 'a' must be a string"),
        (['{"path": "/x", "headers": {"bad name": "v"}}'], r"w\.jsonl:1: 'headers': 'bad name' is not a header"),
        (['{"path": "/x", "headers": {"Content-Length": "3"}}'], r"w\.jsonl:1: 'headers': 'Content-Length' is set"),
    ],
)
def test_a_bad_line_is_an_error_naming_the_line_and_key(tmp_path, lines, message):
    path = _write(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(WorkloadError, match=f"^{re.escape(str(path.parent))}/{message}"):
        load_workload_file(path)


def test_an_empty_unreadable_non_utf8_or_oversized_file_is_an_error_naming_it(tmp_path):
    for text in ("", "\n# only a comment\n\n"):
        with pytest.raises(WorkloadError, match=r"empty\.jsonl: no request templates"):
            load_workload_file(_write(tmp_path, text, "empty.jsonl"))
    with pytest.raises(WorkloadError, match=r"missing\.jsonl: cannot read \(No such file"):
        load_workload_file(tmp_path / "missing.jsonl")
    with pytest.raises(WorkloadError, match=r"latin\.jsonl:2: not UTF-8"):
        load_workload_file(_write(tmp_path, GOOD.encode() + b'\n{"path": "/caf\xe9"}\n', "latin.jsonl"))
    with pytest.raises(WorkloadError, match=r"big\.jsonl:10001: more than 10000 templates"):
        load_workload_file(_write(tmp_path, "\n".join([GOOD] * 10_001), "big.jsonl"))
    assert len(load_workload_file(_write(tmp_path, "\n".join([GOOD] * 10_000), "full.jsonl")).templates) == 10_000
    bom = load_workload_file(_write(tmp_path, b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n", "bom.jsonl"))
    assert bom.templates[0].path == "/ok"


def test_the_stress_client_sends_the_templates_of_a_file(tmp_path):
    seen: list[httpx.Request] = []

    async def server(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    workload = load_workload_file(_write(tmp_path, TWO_TEMPLATES))

    async def run():
        settings = ClientSettings(arrivals="constant")
        async with StressClient("http://fake/app", workload, settings, transport=httpx.MockTransport(server)) as client:
            return await client.measure(200, 0.2)

    result = asyncio.run(run())
    assert result.completed == len(seen) == 40 and result.errors == 0
    sent = [(r.method, r.url.path, r.url.query, r.content, r.headers.get("content-type")) for r in seen]
    expected = [workload.request(i) for i in range(40)]
    assert [(method, path) for method, path, *_ in sent] == [
        (t.method, "/app" + t.path.split("?")[0]) for t in expected
    ]
    assert {s[1:] for s in sent} == {
        ("/app/infer", b"", b'{"inputs": [1, 2]}', "application/json"),
        ("/app/health", b"x=1", b"", None),
    }
    assert all(r.headers.get("x-trace") == "on" for r in seen if r.method == "GET")
