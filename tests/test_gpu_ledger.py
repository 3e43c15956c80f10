"""The GPU lease's ledger (benchmarks/gpu/ledger.py, run.sh plan and lease) on CPU.

A planted ledger (three classes; parts that never ran, failed, ran at older code, ran at the
lease's code, were cut off, and a test group whose file does not exist) must give exactly one
order; the budget, the set-up counted once, the records of a finished, failed and cut-off part,
`run.sh plan`'s command, and `run.sh lease` with every step faked (LEDGER_FAKE_PARTS=1) writing
$OUT/ledger.json part by part, a cut-off part marked cut off, and a killed lease leaving what
finished. The committed ledger: every `gpu`-marked test file in one group, its seeds from the
2026-11-27 lease, every part's shell function defined.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.gpu import ledger as L

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks/gpu/run.sh"
HEAD = "c0ffee"  # the lease's commit in the planted ledger
OLD = "0ld"


def ran(status: str, commit: str = OLD) -> dict:
    return {"commit": commit, "date": "2026-11-27", "gpu": "NVIDIA H200", "status": status,
            "rc": 0 if status == "passed" else 1, "result": None, "logs": []}  # fmt: skip


def bench(name: str, cls: str, last: dict | None, seconds: int = 10, **kw) -> dict:
    return {
        "name": name,
        "class": cls,
        "run": "part_eagle3",
        "seconds": seconds,
        "last": last,
        **kw,
    }


def group(name: str, last: dict | None, files: list[str], seconds: int = 10) -> dict:
    return {"name": name, "class": "gpu-tests", "run": "gpu_group", "seconds": seconds,
            "pytest": {"files": files, "marker": "gpu", "xdist": False}, "last": last}  # fmt: skip


def planted() -> dict:
    here = ["tests/test_gpu_ledger.py"]
    return {
        "priority": ["gpu-tests", "sweeps", "workload"],
        "install_s": 30,
        "overhead_s": 15,
        "setup": {"ckpt": 40},
        "extra_wheels": ["dashscope", "pytest-xdist", "execnet", "msgspec"],
        "parts": [
            bench("w-older", "workload", ran("passed")),
            group("a-older", ran("passed"), here),
            group("b-never", None, here),
            group("c-failed", ran("failed"), here),
            group("d-current", ran("passed", HEAD), here),
            group("e-absent", None, ["tests/test_no_such_file_here.py"]),
            bench("s-never", "sweeps", None),
            bench("w-cut", "workload", ran("cut_off", HEAD)),
            bench("f-failed-now", "gpu-tests", ran("failed", HEAD)),
        ],
    }


def same(a: str, b: str) -> bool:
    return a == b


def names(items) -> list[str]:
    return [p["name"] for p, *_ in items]


# -- order and choice -------------------------------------------------------------------------


def test_due_orders_by_class_then_never_failed_cut_before_older():
    due = L.due(planted(), HEAD, same)
    # gpu-tests: never/failed in ledger order, then older; the part at HEAD (passed or failed)
    # and the absent group are not due; sweeps; workload: the cut-off part before the older one.
    assert names(due) == ["b-never", "c-failed", "a-older", "s-never", "w-cut", "w-older"]
    assert [st for _, st in due] == ["never", "failed", "older", "never", "cut_off", "older"]


def test_status_of_every_kind():
    ledger = planted()
    got = {p["name"]: L.status(p, HEAD, same) for p in ledger["parts"]}
    assert got == {"w-older": "older", "a-older": "older", "b-never": "never",
                   "c-failed": "failed", "d-current": "current", "e-absent": "absent",
                   "s-never": "never", "w-cut": "cut_off", "f-failed-now": "current"}  # fmt: skip


def test_a_dry_run_never_counts_as_a_gpu_run():
    ledger = planted()
    L.start(ledger, "a-older", HEAD, "cpu (dry run)", dry_run=True)
    L.record(ledger, "a-older", [("pytest-a-older", 0, False)], Path("/nonexistent"), "r")
    p = L.part(ledger, "a-older")
    assert p["last"]["status"] == "passed" and p["last"]["dry_run"]
    assert L.status(p, HEAD, same) == "older"  # still the H200 run at OLD that counts


def test_choose_fits_the_budget_in_order_and_counts_setup_once():
    ledger = planted()
    ledger["parts"] = [
        bench("big", "gpu-tests", None, seconds=100),
        bench("x", "gpu-tests", None, seconds=30, needs=["ckpt"]),
        bench("y", "sweeps", None, seconds=30, needs=["ckpt"]),
        bench("z", "workload", None, seconds=20),
    ]
    ordered = L.due(ledger, HEAD, same)
    # 115 s less 15 s of start-up: big (100) fits alone and nothing after it does.
    assert [(p["name"], e) for p, e in L.choose(ledger, ordered, 115)] == [("big", 100)]
    # 114: big does not fit; x brings the checkpoint (30 + 40); y does not fit, z does.
    assert [(p["name"], e) for p, e in L.choose(ledger, ordered, 114)] == [("x", 70), ("z", 20)]
    # Without big, 115: y reuses x's checkpoint (30 s, not 70), and then z does not fit.
    rest = ordered[1:]
    assert [(p["name"], e) for p, e in L.choose(ledger, rest, 115)] == [("x", 70), ("y", 30)]
    assert [(p["name"], e) for p, e in L.choose(ledger, rest, 135)] == [
        ("x", 70), ("y", 30), ("z", 20)]  # fmt: skip
    assert L.choose(ledger, ordered, 10) == []


def test_choose_uses_the_measured_seconds_of_the_last_complete_run():
    ledger = planted()
    last = ran("passed") | {"seconds": 3}
    ledger["parts"] = [bench("m", "gpu-tests", last, seconds=100), bench("n", "sweeps", None)]
    chosen = L.choose(ledger, L.due(ledger, HEAD, same), 30)
    assert [(p["name"], e) for p, e in chosen] == [("m", 3), ("n", 10)]


def test_git_same_code_ignores_results_ledger_and_docs(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip

    def commit(path: str, text: str) -> str:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    c1 = commit("kernels/a.py", "1")
    c2 = commit("benchmarks/results/h200/x/README.md", "r")
    c3 = commit("benchmarks/gpu/ledger.json", "{}")
    c4 = commit("kernels/a.py", "2")
    assert L.git_same_code(c1, c3, tmp_path)
    assert not L.git_same_code(c1, c4, tmp_path)
    assert not L.git_same_code("deadbeef", c1, tmp_path)  # a commit git does not know
    assert L.git_same_code(c2, c2, tmp_path)


# -- records ----------------------------------------------------------------------------------


def test_start_marks_cut_off_and_keeps_the_previous_run():
    ledger = planted()
    L.start(ledger, "a-older", HEAD, "NVIDIA H200", date="2026-12-02")
    p = L.part(ledger, "a-older")
    assert (p["last"]["status"], p["last"]["commit"], p["last"]["date"]) == (
        "cut_off",
        HEAD,
        "2026-12-02",
    )
    assert p["previous"] == ran("passed")
    assert L.status(p, HEAD, same) == "cut_off"  # never current while unfinished


def test_record_passed_failed_and_cut_off(tmp_path):
    kernels = ROOT / "benchmarks/results/h200/2026-11-27/pytest-gpu-kernels.log"
    (tmp_path / "pytest-a-older.log").write_text(kernels.read_text())
    (tmp_path / "bench.json").write_text(json.dumps({"ttft_ms": {"median": 12.5}, "f": 0.6}))
    ledger = planted()
    figures = [["ttft", "bench.json", "ttft_ms.median"], ["frac", "bench.json", "f"]]
    L.part(ledger, "s-never").update(
        figures=figures, goals={"ttft": ["<=", 15], "frac": [">=", 0.7]}
    )
    for name in ("a-older", "b-never", "s-never", "w-older"):
        L.start(ledger, name, HEAD, "NVIDIA H200")

    a = L.record(
        ledger, "a-older", [("pytest-a-older", 1, False)], tmp_path, "benchmarks/results/h200/d"
    )
    assert (a["status"], a["rc"], a["result"]) == ("failed", 1, {"failed": 4, "passed": 388})
    assert a["logs"] == ["benchmarks/results/h200/d/pytest-a-older.log"]
    s = L.record(ledger, "s-never", [("eagle3", 0, False)], tmp_path, "r", elapsed_s=42)
    assert s["status"] == "passed" and s["seconds"] == 42
    assert s["result"] == {
        "figures": {"ttft": 12.5, "frac": 0.6},
        "goals_met": {"ttft": True, "frac": False},
    }
    cut = L.record(ledger, "b-never", [("pytest-b-never", 124, True)], tmp_path, "r")
    assert cut["status"] == "cut_off" and "not a pass" in cut["note"]
    nothing = L.record(ledger, "w-older", [], tmp_path, "r")  # no step ran: not a pass
    assert nothing["status"] == "not_run"
    assert L.status(L.part(ledger, "w-older"), HEAD, same) == "never"
    skipped = L.record(ledger, "b-never", [("eagle3", None, True)], tmp_path, "r")
    assert (skipped["status"], skipped["rc"]) == ("cut_off", None)  # no time left to start it
    assert L.part(ledger, "w-older")["previous"]["status"] == "passed"


def test_parse_pytest_reads_the_2026_11_27_logs():
    d = ROOT / "benchmarks/results/h200/2026-11-27"
    assert L.parse_pytest((d / "pytest-gpu-engine.log").read_text()) == {
        "passed": 41, "skipped": 11, "deselected": 1077}  # fmt: skip
    assert L.parse_pytest((d / "pytest-gpu-memory.log").read_text()) == {
        "failed": 1,
        "deselected": 3,
    }
    assert L.parse_pytest("no summary here\nrc=2\n") == {}


# -- the committed ledger ---------------------------------------------------------------------


def test_committed_ledger_covers_every_gpu_test_file_once():
    ledger = L.load()
    grouped = [f for p in ledger["parts"] for f in p.get("pytest", {}).get("files", [])]
    assert len(grouped) == len(set(grouped)), "a test file in two groups"
    marked = sorted(
        f"tests/{f.name}"
        for f in (ROOT / "tests").glob("test_*.py")
        if re.search(r"mark\.gpu\b", f.read_text())
    )
    missing = [f for f in marked if f not in grouped]
    assert not missing, (
        f"gpu-marked test files in no group of benchmarks/gpu/ledger.json: {missing}"
    )


def test_committed_ledger_priority_seeds_and_functions():
    ledger = L.load()
    assert ledger["priority"] == ["gpu-tests", "sweeps", "workload-0.6B", "serving-ttft", "spec",
                                  "kv-tiers", "fp8", "moe", "lora", "pooling", "rl", "8B"]  # fmt: skip
    shell = RUN.read_text() + (ROOT / "benchmarks/gpu/lease_parts.sh").read_text()
    defined = set(re.findall(r"^(\w+)\(\) \{", shell, re.M))
    seeded = {}
    for p in ledger["parts"]:
        assert p["run"] in defined, f"{p['name']}: no shell function {p['run']}"
        if p["last"]:
            seeded[p["name"]] = p["last"]["status"]
            assert p["last"]["commit"].startswith("1f29c4b") and p["last"]["gpu"] == "NVIDIA H200"
            for log in p["last"]["logs"]:
                assert (ROOT / log).exists(), log
    assert seeded == {"gpu-kernels": "failed", "gpu-engine": "passed", "gpu-memory": "failed",
                      "greedy": "failed", "decode-sweep": "passed", "attention-micro": "passed",
                      "bench-0.6B-async": "passed", "profile-256": "passed", "profile-1": "passed",
                      "bench-0.6B-sync": "passed", "serving": "passed"}  # fmt: skip
    assert L.part(ledger, "gpu-kernels")["last"]["result"] == {"passed": 388, "failed": 4}


# -- run.sh plan and lease --------------------------------------------------------------------


def git_head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


def write(ledger: dict, path: Path) -> Path:
    path.write_text(json.dumps(ledger))
    return path


def test_run_sh_plan_prints_the_command_for_the_chosen_parts(tmp_path):
    ledger = planted()
    head = git_head()
    for p in ledger["parts"]:  # the planted HEAD is this checkout's
        if p["last"] and p["last"]["commit"] == HEAD:
            p["last"]["commit"] = head
    L.part(ledger, "w-older")["wheels"] = ["sglang==0.5.23"]
    env = {**os.environ, "LEDGER": str(write(ledger, tmp_path / "ledger.json"))}
    out = subprocess.run(["bash", str(RUN), "plan", "105"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    # 105 s less 30 of install and 15 of start-up: 60 s, six parts of 10 s.
    parts = "b-never,c-failed,a-older,s-never,w-cut,w-older"
    assert f"LEASE_PARTS={parts} LEASE_DEADLINE=75 bash benchmarks/gpu/run.sh lease" in out
    assert f"LEASE_COMMIT={head} " in out
    assert "fetch-wheels.sh dashscope pytest-xdist execnet msgspec sglang==0.5.23" in out
    assert "timeout_s=165" in out and "Absent (no test file yet): e-absent" in out
    assert "Current: d-current, f-failed-now" in out
    small = subprocess.run(["bash", str(RUN), "plan", "75"], env=env, capture_output=True,
                           text=True, timeout=60, check=True).stdout  # fmt: skip
    assert "LEASE_PARTS=b-never,c-failed,a-older " in small
    assert "sglang" not in small  # w-older (which needs it) does not fit
    assert "Due but not in this budget (next lease): s-never, w-cut, w-older" in small


def test_plan_caps_one_call_at_540_seconds():
    text = L.plan_text(planted(), HEAD, 900, same)
    assert "LEASE_DEADLINE=510 " in text and "timeout_s=600" in text and "at most 540 s" in text


def lease_env(tmp_path: Path, ledger: dict, **extra: str) -> dict:
    return {**os.environ, "LEDGER": str(write(ledger, tmp_path / "planted.json")),
            "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
            "LEDGER_FAKE_PARTS": "1", "LEASE_COMMIT": HEAD, "STEP_MIN_S": "1", **extra}  # fmt: skip


def one_second_parts() -> dict:
    ledger = planted()
    for p in ledger["parts"]:
        p["seconds"] = 1
    return ledger


def test_fake_lease_records_part_by_part_and_marks_the_cut_off_part(tmp_path):
    # c-failed's step exits 1; s-never's step outlasts the deadline; w-cut and w-older then
    # have no time left and are not started.
    env = lease_env(tmp_path, one_second_parts(), LEASE_DEADLINE="20",
                    LEDGER_FAKE="pytest-c-failed:0:1 eagle3:60:0")  # fmt: skip
    r = subprocess.run(["bash", str(RUN), "lease"], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    recorded = re.findall(r"^ledger: (\S+) (\S+)", r.stdout, re.M)
    assert recorded == [("b-never", "passed"), ("c-failed", "failed"), ("a-older", "passed"),
                        ("s-never", "cut_off")]  # fmt: skip
    out = L.load(tmp_path / "out/ledger.json")
    last = {p["name"]: p["last"] for p in out["parts"]}
    assert [last[n]["status"] for n in ("b-never", "c-failed", "a-older", "s-never")] == [
        "passed", "failed", "passed", "cut_off"]  # fmt: skip
    assert all(
        last[n]["commit"] == HEAD and last[n]["gpu"] == "fake" for n in ("b-never", "s-never")
    )
    assert last["c-failed"]["rc"] == 1 and last["s-never"]["rc"] == 124
    assert last["b-never"]["logs"] == [
        f"benchmarks/results/fake/{last['b-never']['date']}/pytest-b-never.log"
    ]
    assert last["w-older"] == ran("passed") and last["w-cut"] == ran("cut_off", HEAD)  # untouched
    # A second lease continues where this one stopped.
    assert names(L.due(out, HEAD, same)) == ["s-never", "w-cut", "w-older"]


def test_a_killed_lease_leaves_what_finished_and_the_part_in_flight_cut_off(tmp_path):
    env = lease_env(tmp_path, one_second_parts(), LEASE_DEADLINE="300",
                    LEDGER_FAKE="pytest-a-older:60:0")  # fmt: skip
    proc = subprocess.Popen(["bash", str(RUN), "lease"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    path = tmp_path / "out/ledger.json"
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            if path.exists():
                a = L.part(L.load(path), "a-older")["last"]
                if a["commit"] == HEAD:  # a-older has started
                    break
            time.sleep(0.2)
        else:
            pytest.fail("a-older never started")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole lease, as the device call's limit does
        proc.wait()
    last = {p["name"]: p["last"] for p in L.load(path)["parts"]}
    assert (last["b-never"]["status"], last["c-failed"]["status"]) == ("passed", "passed")
    assert last["a-older"]["status"] == "cut_off" and last["a-older"]["rc"] is None
    assert L.part(L.load(path), "a-older")["previous"] == ran("passed")
    assert last["s-never"] is None


def test_lease_runs_the_parts_named_in_lease_parts_in_that_order(tmp_path):
    ledger = copy.deepcopy(one_second_parts())
    env = lease_env(tmp_path, ledger, LEASE_DEADLINE="60", LEASE_PARTS="s-never,b-never")
    r = subprocess.run(["bash", str(RUN), "lease"], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert re.findall(r"^ledger: (\S+) (\S+)", r.stdout, re.M) == [
        ("s-never", "passed"), ("b-never", "passed")]  # fmt: skip
