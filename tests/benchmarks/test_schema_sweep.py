"""``scripts/schema_sweep.py``: a folder per dataset in, acceptance and validity out."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.benchmarks.gpu_report import REPO, load_script


def write_datasets(root) -> None:
    """Two datasets: plain schemas, and the ``{"schema", "tests"}`` layout."""
    (root / "plain").mkdir()
    (root / "wrapped").mkdir()
    (root / "plain" / "point.json").write_text(json.dumps(
        {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "format": "int32"},
                        "y": {"type": "integer", "maximum": 9}}}))
    (root / "plain" / "not.json").write_text(json.dumps({"not": {"pattern": "x.*y"}}))
    (root / "wrapped" / "flag.json").write_text(json.dumps(
        {"schema": {"type": "boolean"}, "tests": [{"data": True, "valid": True}]}))


def test_the_sweep_counts_refusals_and_validates_complete_outputs(tmp_path):
    write_datasets(tmp_path)
    out = tmp_path / "sweep.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "schema_sweep.py"), "--dir",
                    str(tmp_path), "--per-dataset", "5", "--max-tokens", "40", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    record = json.loads(out.read_text())
    assert (record["schemas"], record["accepted"], record["refused"]) == (3, 2, 1)
    assert list(record["refused_files"]) == ["plain/not.json"]
    assert "not" in record["refusal_reasons"].popitem()[0]
    assert sum(record["finish_reasons"].values()) == 2
    assert record["complete_outputs_invalid"] == 0


def test_the_sweep_compile_only_counts_refusals_and_generates_nothing(tmp_path):
    write_datasets(tmp_path)
    out = tmp_path / "sweep.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "schema_sweep.py"), "--dir",
                    str(tmp_path), "--per-dataset", "5", "--compile-only", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    record = json.loads(out.read_text())
    assert (record["schemas"], record["accepted"], record["refused"]) == (3, 2, 1)
    assert list(record["refused_files"]) == ["plain/not.json"]
    assert record["finish_reasons"] == {} and record["settings"]["compile_only"]


def test_an_output_outside_its_schema_is_reported():
    sweep = load_script("schema_sweep")
    schema = {"type": "object", "required": ["a"]}
    assert sweep.invalid_reason(schema, '{"a": 1}') is None
    assert sweep.invalid_reason(schema, '{"b": 1}').startswith("invalid: 'a' is a required")
    assert sweep.invalid_reason(schema, '{"a": ').startswith("not JSON")
    tools = {"t": schema}  # calls are checked against their own tool's parameters
    assert sweep.invalid_reason({}, '[{"name": "t", "arguments": {"a": 1}}]', tools) is None
    assert sweep.invalid_reason({}, '[{"name": "t", "arguments": {}}]', tools).startswith("invalid")


def test_the_tools_sweep_offers_the_schemas_as_required_tools(tmp_path):
    sweep = load_script("schema_sweep")
    write_datasets(tmp_path)
    (tmp_path / "plain" / "more.json").write_text(json.dumps({"type": "object"}))
    requests = sweep.as_tools(sweep.load_sample(tmp_path, 5, seed=0), seed=0)
    assert len(requests) == 2
    for files, request in requests:
        assert len(request["tools"]) == files.count(" + ") + 1
        compiles_alone = all(sweep.refusal(p) is None for p in request["tools"].values())
        assert (sweep.refusal(request["schema"]) is None) == compiles_alone
