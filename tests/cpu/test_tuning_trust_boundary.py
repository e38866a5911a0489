"""The tuned-results store as a trust boundary: crafted exports imported through the CLI into an
empty cache. For every case: nothing is written outside the cache root, no traceback is printed,
the export afterwards holds no invalid entry, and a good entry imported first is still there,
unchanged. Then the same entries met in a shared cache file (not imported): skipped, counted,
and never in the way of a lookup."""

import copy
import json
import math

import pytest
from tuning_fakes import SCOPE, FakeBackend

from cutlass_ops.gemms import dispatch
from cutlass_ops.gemms.grouped import grouped_entries
from cutlass_ops.gemms.grouped.grouped_build import GroupedProblem
from custom_kernels.core import tuned_store
from tuning import cli

GROUPED_PROBLEM = GroupedProblem("2d3d", 8, 256, 4096, 4096)
GOOD_GROUPED = {"problem": GROUPED_PROBLEM.to_dict(), "prefer": "cutlass", "winner_ms": 0.17,
                "torch_ms": 0.2, "winner": "grouped-bf16-tn-cooperative-t128x256x64-c2x1"}


@pytest.fixture
def root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(root))
    monkeypatch.setattr(cli, "make_backend", lambda args: FakeBackend())
    dispatch.reset()
    return root


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return code, out, err


@pytest.fixture
def good_gemm(root, capsys, tmp_path):
    """A GEMM entry a real (fake-backend) tune wrote, as an export document: (key, entry)."""
    assert run(capsys, "tune", "16x4096x4096", "--strategy", "quick", "--no-heuristics")[0] == 0
    export = tmp_path / "good.json"
    assert run(capsys, "export", export)[0] == 0
    assert run(capsys, "clear", "--yes")[0] == 0
    (key, entry), = json.loads(export.read_text())["caches"][0]["entries"].items()
    return key, entry


def document(family, entries, scope=None):
    return {"format": 1, "family": family, "scope": scope or SCOPE.to_dict(), "entries": entries}


def import_file(capsys, tmp_path, data, name="crafted.json"):
    path = tmp_path / name
    text = data if isinstance(data, str) else json.dumps(data)
    # 1e400 is valid JSON that Python reads as infinity (json.dumps would write "Infinity").
    path.write_text(text.replace('"__1e400__"', "1e400"))
    return run(capsys, "import", path)


INPUTS = {"good.json", "first.json", "crafted.json", "after.json", "bad.json", "merged.json",
          "a.json", "b.json", "nan.json"}  # what the tests write, beside the cache root


def files_outside(tmp_path, root):
    """Every file under tmp_path that is neither in the cache root nor an input we wrote."""
    return sorted(str(p) for p in tmp_path.rglob("*") if p.is_file() and root not in p.parents
                  and not (p.parent == tmp_path and p.name in INPUTS))


def exported(capsys, tmp_path):
    path = tmp_path / "after.json"
    assert run(capsys, "export", path)[0] == 0
    return {(doc["family"], key): entry for doc in json.loads(path.read_text())["caches"]
            for key, entry in doc["entries"].items()}


def with_good_entries_first(capsys, tmp_path, good_gemm):
    key, entry = good_gemm
    code, _, err = import_file(capsys, tmp_path, tuned_store.bundle([
        document("gemm", {key: entry}),
        document("grouped", {GROUPED_PROBLEM.name: GOOD_GROUPED})]), "first.json")
    assert code == 0, err
    return {("gemm", key): entry, ("grouped", GROUPED_PROBLEM.name): GOOD_GROUPED}


def crafted_entries(good_gemm) -> dict:
    """name: (family, key, entry, what the rejection says). Each must be refused."""
    key, entry = good_gemm
    bigger = dict(entry, problem=dict(entry["problem"], m=10**400))
    other_key = key.replace("16x4096x4096", "2048x4096x4096")
    cases = [
        ("fp16 kernel for bf16 data", "grouped", GROUPED_PROBLEM.name,
         dict(GOOD_GROUPED, winner="grouped-f16-tn-cooperative-t128x256x64-c2x1"),
         "compiled for f16/t/n operands"),
        ("wrong layouts", "grouped", GROUPED_PROBLEM.name,
         dict(GOOD_GROUPED, winner="grouped-bf16-nn-cooperative-t128x256x64-c2x1"),
         "compiled for bf16/n/n"),
        ("skew pair for dW", "grouped", GROUPED_PROBLEM.name.replace("2d3d", "2d2d"),
         dict(GOOD_GROUPED, problem=dict(GOOD_GROUPED["problem"], form="2d2d"),
              winner="skew-x2-grouped-bf16-tn-cooperative-t128x256x64-c2x1+"
                     "grouped-bf16-tn-pingpong-t64x128x64-c1x1"), "skew dispatch"),
        ("a shell command as the winner", "gemm", key, dict(entry, winner="rm -rf /"),
         "winner is not an object"),
        ("a winner of another shape", "gemm", key,
         dict(entry, winner={"config": {"tile": "128x128"}}), "winner"),
        ("m beyond any launcher", "gemm", key.replace("16x", f"{2**32 + 16}x"),
         dict(entry, problem=dict(entry["problem"], m=2**32 + 16)), "is outside 1..2147483647"),
        ("a 400-digit m", "gemm", key, bigger, "beyond 64 bits"),
        ("a key of 400 digits", "gemm", key.replace("16x", f"{10**400}x"), bigger,
         "a key of 1 to 400 characters"),
        ("a negative time", "gemm", key, dict(entry, winner_ms=-5), "winner_ms = -5"),
        ("a time that is a string", "gemm", key, dict(entry, winner_ms="0.001"),
         "winner_ms is not a number"),
        ("an infinite time", "gemm", key, dict(entry, winner_ms="__1e400__"), "finite"),
        ("a key naming another problem", "gemm", other_key,
         dict(entry, problem=dict(entry["problem"], m=1000, n=18944, k=3584)),
         "its key is not its problem's name"),
        ("a list for an entry", "gemm", key, [entry], "the entry is not an object"),
        ("an unknown field", "gemm", key, dict(entry, code="import os"), "unknown fields"),
        ("a runner-up that is not an object", "gemm", key, dict(entry, runners_up=["x"]),
         "an item of runners_up"),
        ("an sm100a winner on an sm90 GPU", "gemm", key,
         dict(entry, winner={"config": {"arch": "sm100a", "kernel_schedule": "1sm",
                                        "epilogue_schedule": "tma"}, "swap_ab": False}),
         "sm100a kernel"),
        ("an FP8 skinny kernel for bf16 data", "gemm", key,
         dict(entry, winner={"backend": "skinny", "name": "skinny-m16-s4-p6"}),
         "cannot run bf16"),
        ("a bool for an integer", "gemm", key,
         dict(entry, problem=dict(entry["problem"], batch=True)), "stored form"),
        ("a norm config that cannot run its problem", "norms",
         "norm-rms-fwd-h4096-bfloat16-bfloat16-bfloat16",
         {"problem": {"kind": "rms", "direction": "fwd", "hidden": 4096, "dtype": "bfloat16",
                      "out_dtype": "bfloat16", "weight_dtype": "bfloat16", "aligned": True,
                      "residual": False},
          "winner": "t256_r8_c2_v8_s2", "winner_ms": 0.01}, "cannot run"),
    ]
    return {name: rest for name, *rest in cases}


CRAFTED = ["fp16 kernel for bf16 data", "wrong layouts", "skew pair for dW",
           "a shell command as the winner", "a winner of another shape",
           "m beyond any launcher", "a 400-digit m", "a key of 400 digits", "a negative time", "a time that is a string",
           "an infinite time", "a key naming another problem", "a list for an entry",
           "an unknown field", "a runner-up that is not an object",
           "an sm100a winner on an sm90 GPU", "an FP8 skinny kernel for bf16 data",
           "a bool for an integer",
           "a norm config that cannot run its problem"]


@pytest.fixture(params=CRAFTED)
def crafted(request, good_gemm):
    return (request.param, *crafted_entries(good_gemm)[request.param])


def test_each_crafted_entry_is_refused_and_changes_nothing(root, capsys, tmp_path, good_gemm,
                                                           crafted, caplog):
    name, family, key, entry, reason = crafted
    before = with_good_entries_first(capsys, tmp_path, good_gemm)
    code, out, err = import_file(capsys, tmp_path, document(family, {key: entry}))
    assert code == 1, name  # refused: the exit code says so
    assert "0 entries added or improved" in out and "1 rejected" in out
    assert reason in caplog.text, caplog.text
    assert exported(capsys, tmp_path) == before  # the good entries unchanged, no other entry
    assert files_outside(tmp_path, root) == []
    for argv in (("list",), ("show", "16x4096x4096"), ("doctor",)):
        assert run(capsys, *argv)[0] in (0, 1)


@pytest.mark.parametrize("field", ["gpu", "compute_capability", "sm_count", "driver", "cuda",
                                   "cutlass", "library"])
def test_a_scope_that_reaches_outside_the_cache_is_refused(root, capsys, tmp_path, good_gemm,
                                                           field):
    before = with_good_entries_first(capsys, tmp_path, good_gemm)
    escape = tmp_path / "escaped"
    key, entry = good_gemm
    for value in (f"90/../../../..{escape}", "../../../escaped", "9.0\x00", "a/b", 10**30,
                  ["90"], None):
        scope = dict(SCOPE.to_dict(), **{field: value})
        code, out, err = import_file(capsys, tmp_path, document("gemm", {key: entry}, scope))
        assert code == 1 and "1 rejected" in out
    assert not escape.exists() and files_outside(tmp_path, root) == []
    assert exported(capsys, tmp_path) == before


def test_a_compute_capability_as_text_of_digits_is_accepted(root, capsys, tmp_path, good_gemm):
    key, entry = good_gemm
    scope = dict(SCOPE.to_dict(), compute_capability="9.0")
    code, out, err = import_file(capsys, tmp_path, document("gemm", {key: entry}, scope))
    assert code == 0 and "1 entries added" in out, err
    (doc,) = json.loads(json.dumps(list(exported(capsys, tmp_path).values())))
    assert doc == entry


@pytest.mark.parametrize("family", ["softmax", "../norms", "norms/../../x", "", None, 7])
def test_unknown_families_are_refused(root, capsys, tmp_path, good_gemm, family):
    before = with_good_entries_first(capsys, tmp_path, good_gemm)
    key, entry = good_gemm
    code, out, err = import_file(capsys, tmp_path, document(family, {key: entry}))
    assert code == 1 and "1 rejected" in out
    assert exported(capsys, tmp_path) == before and files_outside(tmp_path, root) == []


@pytest.mark.parametrize("text, says", [
    ('{"format": 1, "kind": "cutlass-ops-tuning-bundle", "caches": [', "not a readable JSON"),
    ('{"format": 1, "format": 1, "scope": {}, "entries": {}}', "appears twice"),
    ('{"format": 1, "scope": {}, "entries": {"a": NaN}}', "NaN is not a JSON number"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"format": 1, "entries": 3}', "not a cutlass-ops tuning cache export"),
    ("\xff\xfe", "not a readable JSON"),
])
def test_files_that_are_not_exports_are_one_line(root, capsys, tmp_path, good_gemm, text, says):
    before = with_good_entries_first(capsys, tmp_path, good_gemm)
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff\xfe"
                     else b"\xff\xfe")
    code, out, err = run(capsys, "import", path)
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert exported(capsys, tmp_path) == before


def test_a_duplicate_key_in_an_entries_object_refuses_the_file(root, capsys, tmp_path, good_gemm):
    key, entry = good_gemm
    text = json.dumps(document("gemm", {key: entry}))
    doubled = text.replace(f'"{key}": ', f'"{key}": {json.dumps(entry)}, "{key}": ', 1)
    code, _, err = import_file(capsys, tmp_path, doubled)
    assert code == 2 and "appears twice" in err


def test_an_oversized_file_is_refused_before_it_is_read(root, capsys, tmp_path, good_gemm,
                                                        monkeypatch):
    key, entry = good_gemm
    monkeypatch.setattr(tuned_store, "MAX_FILE_BYTES", 1000)
    big = document("gemm", {key: dict(entry, strategy="x" * 400)})
    big["padding"] = "y" * 2000
    code, _, err = import_file(capsys, tmp_path, big)
    assert code == 2 and "refused" in err and "MiB" in err


def test_a_faster_claim_replaces_only_when_valid_and_merge_keeps_the_better(root, capsys,
                                                                          tmp_path, good_gemm):
    key, entry = good_gemm
    with_good_entries_first(capsys, tmp_path, good_gemm)
    faster = dict(entry, winner_ms=entry["winner_ms"] / 2)
    slower = dict(entry, winner_ms=entry["winner_ms"] * 2)
    assert import_file(capsys, tmp_path, document("gemm", {key: slower}))[0] == 0
    assert exported(capsys, tmp_path)[("gemm", key)] == entry  # the better one stays
    merged = tmp_path / "merged.json"
    for name, doc in (("a.json", document("gemm", {key: faster})),
                      ("b.json", document("gemm", {key: dict(entry, winner_ms=-1.0)})),
                      ("nan.json", document("gemm", {key: dict(entry, winner_ms=math.nan)}))):
        (tmp_path / name).write_text(json.dumps(doc))
    code, _, err = run(capsys, "merge", tmp_path / "nan.json", "-o", merged)
    assert code == 2 and "NaN is not a JSON number" in err and not merged.exists()
    code, out, err = run(capsys, "merge", tmp_path / "a.json", tmp_path / "b.json", "-o", merged)
    assert code == 1 and "1 rejected" in out
    (doc,) = json.loads(merged.read_text())["caches"]
    assert doc["entries"] == {key: faster}
    assert run(capsys, "import", merged)[0] == 0
    assert exported(capsys, tmp_path)[("gemm", key)] == faster


# ---- the same entries in a shared cache file, not imported -------------------------------------

def test_bad_entries_in_a_cache_file_are_skipped_counted_and_never_break_a_lookup(
        root, capsys, tmp_path, good_gemm, caplog):
    from cutlass_ops.gemms.config import GemmProblem
    from cutlass_ops.gemms.gemm_entries import gemm_cache

    key, entry = good_gemm
    cache = gemm_cache(SCOPE)
    cache.put(GemmProblem.from_dict(entry["problem"]), entry)
    data = json.loads(cache.path.read_text())
    bad = dict(entry, winner="rm -rf /")
    huge = dict(entry, problem=dict(entry["problem"], m=10**400))
    data["entries"].update({key.replace("16x", "32x"): dict(bad, problem=dict(
        entry["problem"], m=32)), key.replace("16x", f"{10**400}x"): huge, "list": [1]})
    cache.path.write_text(json.dumps(data))

    assert set(cache.entries()) == {key} and len(cache.rejections()) == 3
    assert caplog.text.count("rejected") == 3 and str(cache.path) in caplog.text
    problem = GemmProblem.from_dict(dict(entry["problem"], m=64))  # untuned: the nearest's
    decision = dispatch.decide(problem, cache.entries(), _device(), is_built=lambda c: True,
                               built_choices=lambda: [])
    assert decision.source == "nearest"
    code, out, err = run(capsys, "list")
    assert code == 0 and "16x4096x4096" in out and "3 stored entries were rejected" in err
    code, out, _ = run(capsys, "doctor")
    assert "3 rejected" in out


def test_clear_reaches_every_family(root, capsys, tmp_path, good_gemm):
    with_good_entries_first(capsys, tmp_path, good_gemm)
    code, out, _ = run(capsys, "clear", "--yes", "--family", "grouped")
    assert code == 0 and "deleted 1" in out
    assert {family for family, _ in exported(capsys, tmp_path)} == {"gemm"}
    code, out, _ = run(capsys, "clear", "--yes")
    assert code == 0 and exported(capsys, tmp_path) == {}
    assert not list((root).rglob("*.json"))


def test_a_grouped_entry_of_the_wrong_element_type_is_never_looked_up(root, monkeypatch):
    from custom_kernels.core.tuned_store import TuningCache

    cache = TuningCache(SCOPE, grouped_entries.SCHEMA)
    monkeypatch.setattr(grouped_entries, "grouped_cache", lambda device=None: cache)
    report = cache.merge({GROUPED_PROBLEM.name: dict(
        GOOD_GROUPED, winner="grouped-f16-tn-cooperative-t128x256x64-c2x1")})
    assert report.changed == 0 and grouped_entries.tuned_config(GROUPED_PROBLEM) is None
    cache.merge({GROUPED_PROBLEM.name: copy.deepcopy(GOOD_GROUPED)})
    assert grouped_entries.tuned_config(GROUPED_PROBLEM).element == "bf16"


def _device():
    from custom_kernels.core.device import named_spec

    return named_spec("H100")


def test_the_grouped_launcher_refuses_a_kernel_of_another_element_type_or_layout():
    """The last check before a launch (GPU test: tests/gpu/moe/test_grouped_gpu.py): it runs before
    any build, so CPU tensors show it."""
    import torch

    from cutlass_ops.gemms.grouped import grouped_runtime
    from cutlass_ops.gemms.grouped.grouped_build import GroupedConfig
    from custom_kernels.core.errors import UnsupportedInputError

    x = torch.randn(64, 32, dtype=torch.bfloat16)
    wt = torch.randn(4, 48, 32, dtype=torch.bfloat16).transpose(1, 2)  # column-major B
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    out = torch.empty(64, 48, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInputError, match="compiled for f16 operands; A is"):
        grouped_runtime.run(GroupedConfig("f16", "t", "n"), "2d3d", x, wt, offs, out)
    with pytest.raises(UnsupportedInputError, match="the output is torch.float16"):
        grouped_runtime.run(GroupedConfig("bf16", "t", "n"), "2d3d", x, wt, offs, out.half())
    with pytest.raises(UnsupportedInputError, match="compiled for layouts tt; A and B are tn"):
        grouped_runtime.run(GroupedConfig("bf16", "t", "t"), "2d3d", x, wt, offs, out)
