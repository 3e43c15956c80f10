"""The GPU pass's ledger: what each part last ran at, and which parts the next lease runs.

`benchmarks/gpu/ledger.json` (committed) lists every part of the GPU pass: each `gpu` test group,
each sweep, each benchmark, each with its priority class, estimated seconds and its last run
(`last`: commit, date, GPU, status, rc, result, logs; null when it never ran). This module owns
that file's reading, ordering and updating; `run.sh` owns running the parts. Pure Python (no
torch, no third-party import), so that `run.sh plan` works on any CPU machine.

Order (`due`): the ledger's `priority` classes in turn (the `gpu` tests first: they found a crash
at every lease so far; the attention sweeps before the workloads that read their tables); within
a class, first what never ran, failed or was cut off, then what ran at older code; in the
ledger's own order after that. A part whose last complete run (passed or failed) is at the code
of `head` is not due: a second lease continues where the first stopped. "The same code" means
the two commits differ only in results, the ledger and documentation (`git_same_code`), so that the
commit that brings a lease's results back does not make every part due again.

Choosing (`choose`): in that order, each part that still fits in the budget (its seconds, plus
its checkpoint's set-up the first time one is needed); one that does not fit is passed over for a
later, shorter one.

Updating: `start` marks a part cut off before it runs (a lease killed mid-part leaves it so,
never passed) and keeps the previous run under `previous`; `record` replaces that with the
part's status from its steps (`STEP rc cut` lines written by run.sh's step()), pytest counts
parsed from the logs and the figures read from its JSON results (`not_run` when no step ran: it
counts as never run). Each writes the whole ledger
again (to a temporary file, then renamed), so `$OUT/ledger.json` is always whole.

    python benchmarks/gpu/ledger.py plan [--budget S] [--ledger PATH] [--head COMMIT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEDGER = Path(__file__).resolve().with_name("ledger.json")

# Changes under these paths leave a part's last run standing (see the module docstring).
NOT_CODE = ("benchmarks/results", "benchmarks/gpu/ledger.json", "docs", "*.md")

DUE_FIRST = ("never", "failed", "cut_off")  # within a class, before "older"
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")
PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ \w+.*) in [\d.]+s")


def load(path: Path | str = LEDGER) -> dict:
    with open(path) as f:
        ledger = json.load(f)
    names = [p["name"] for p in ledger["parts"]]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a part name appears twice")
    for p in ledger["parts"]:
        if p["class"] not in ledger["priority"]:
            raise ValueError(f"{path}: part {p['name']} has unknown class {p['class']!r}")
    return ledger


def save(ledger: dict, path: Path | str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ledger, indent=1) + "\n")
    os.replace(tmp, path)  # a lease killed while writing leaves the previous whole ledger


def part(ledger: dict, name: str) -> dict:
    for p in ledger["parts"]:
        if p["name"] == name:
            return p
    raise ValueError(f"no part {name!r} in the ledger")


def git_same_code(a: str, b: str, root: Path = ROOT) -> bool:
    """True when commits a and b differ only outside the code (NOT_CODE); False when unknown."""
    if a == b:
        return True
    excludes = [f":(exclude){p}" for p in NOT_CODE]
    try:
        r = subprocess.run(
            ["git", "-C", str(root), "diff", "--quiet", a, b, "--", ".", *excludes],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0  # 1: they differ; 128: a commit git does not know


def present_files(p: dict, root: Path = ROOT) -> list[str]:
    return [f for f in p.get("pytest", {}).get("files", []) if (root / f).exists()]


def effective_last(p: dict) -> dict | None:
    """The last run that counts: a CPU dry run of the lease (`dry_run`) proves nothing on a GPU."""
    last = p.get("last")
    return p.get("previous") if last and last.get("dry_run") else last


def status(p: dict, head: str, same_code: Callable[[str, str], bool], root: Path = ROOT) -> str:
    """never | failed | cut_off | older | current | absent (a test group none of whose files
    exist). A recorded `not_run` (no step ran) counts as never."""
    if "pytest" in p and not present_files(p, root):
        return "absent"
    last = effective_last(p)
    if not last or not last.get("status"):
        return "never"
    st = last["status"]
    if st == "not_run":
        return "never"
    if st == "cut_off":
        return "cut_off"  # never current: it did not finish
    if last.get("commit") and same_code(last["commit"], head):
        return "current"
    return "failed" if st == "failed" else "older"


def due(
    ledger: dict,
    head: str,
    same_code: Callable[[str, str], bool] = git_same_code,
    root: Path = ROOT,
) -> list[tuple[dict, str]]:
    """The parts a lease at `head` should run, most valuable first, with their status."""
    rank = {c: i for i, c in enumerate(ledger["priority"])}
    out = []
    for i, p in enumerate(ledger["parts"]):
        st = status(p, head, same_code, root)
        if st in ("current", "absent"):
            continue
        out.append(((rank[p["class"]], 0 if st in DUE_FIRST else 1, i), p, st))
    out.sort(key=lambda t: t[0])
    return [(p, st) for _, p, st in out]


def seconds(p: dict) -> int:
    """The part's wall time: as measured at its last complete run, else the ledger's estimate."""
    last = effective_last(p) or {}
    measured = last.get("seconds") if last.get("status") in ("passed", "failed") else None
    return int(measured) if measured else int(p["seconds"])


def choose(
    ledger: dict, ordered: list[tuple[dict, str]], budget_s: float, overhead: bool = True
) -> list[tuple[dict, int]]:
    """The parts of `ordered` that fit in budget_s, in order, each with its estimate (set-up
    included); `overhead`: the lease's own start-up (env_info) is still to come out of it."""
    setup = ledger.get("setup", {})
    left = budget_s - (ledger.get("overhead_s", 0) if overhead else 0)
    ready: set[str] = set()
    chosen = []
    for p, _ in ordered:
        extra = [n for n in p.get("needs", []) if n not in ready]
        est = seconds(p) + sum(setup[n] for n in extra)
        if est > left:
            continue  # a later, shorter part may still fit
        left -= est
        ready.update(extra)
        chosen.append((p, est))
    return chosen


def start(
    ledger: dict, name: str, commit: str, gpu: str, date: str | None = None, dry_run: bool = False
) -> None:
    """Marks `name` cut off at `commit` until `record` says otherwise."""
    p = part(ledger, name)
    last = p.get("last")
    if last and last.get("status") != "cut_off" and not last.get("dry_run"):
        p["previous"] = last  # the last complete run stays readable
    p["last"] = {
        "commit": commit,
        "date": date or _today(),
        "gpu": gpu,
        "status": "cut_off",
        "rc": None,
        "result": None,
        "logs": [],
        "note": "started; the lease ended before it finished",
    }
    if dry_run:
        p["last"]["dry_run"] = True


def parse_pytest(text: str) -> dict[str, int]:
    """pytest's last summary line as counts: '4 failed, 388 passed in 84.35s' -> {...}."""
    counts: dict[str, int] = {}
    for line in reversed(text.splitlines()):
        m = PYTEST_SUMMARY.match(line.strip())
        if m:
            for n, what in PYTEST_COUNT.findall(m.group(1)):
                counts["errors" if what.startswith("error") else what] = int(n)
            break
    return counts


def _dotted(d: object, key: str) -> object:
    for k in key.split("."):
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def record(
    ledger: dict,
    name: str,
    steps: list[tuple[str, int | None, bool]],
    work: Path,
    results_dir: str,
    elapsed_s: int | None = None,
) -> dict:
    """Sets `name`'s last run from its steps (name, rc, cut off by the deadline); returns it."""
    p = part(ledger, name)
    last = p["last"]  # written by start(): commit, date, gpu
    cut = any(c for _, _, c in steps)
    rcs = [rc for _, rc, _ in steps if rc is not None]
    counts: dict[str, int] = {}
    for step_name, _, _ in steps:
        log = work / f"{step_name}.log"
        if log.exists() and step_name.startswith("pytest"):
            for k, v in parse_pytest(log.read_text(errors="replace")).items():
                counts[k] = counts.get(k, 0) + v
    figures = {}
    for label, fname, key in p.get("figures", []):
        try:
            value = _dotted(json.loads((work / fname).read_text()), key)
        except (OSError, ValueError):
            value = None
        figures[label] = value
    result: dict = {**counts, **({"figures": figures} if figures else {})}
    goals = {}
    for label, (op, target) in p.get("goals", {}).items():
        v = figures.get(label)
        if isinstance(v, (int, float)):
            goals[label] = v >= target if op == ">=" else v <= target
    if goals:
        result["goals_met"] = goals
    if not steps:
        st, note = "not_run", "no step ran (the part has nothing to run on this machine)"
    elif cut:
        st, note = "cut_off", "cut off by the lease's deadline; not a pass"
    elif any(rcs) or counts.get("failed") or counts.get("errors"):
        st, note = "failed", None
    else:
        st, note = "passed", None
    last.update(
        status=st,
        rc=max(rcs, key=abs) if rcs else None,
        result=result or None,
        logs=[f"{results_dir}/{s}.log" for s, _, _ in steps],
        seconds=elapsed_s,
        note=note,
    )
    if note is None:
        del last["note"]
    return last


def read_steps(path: Path) -> list[tuple[str, int | None, bool]]:
    """run.sh step()'s lines: `NAME RC CUT` (CUT 1 when the deadline stopped or skipped it; RC
    `-` for a step the deadline left no time to start)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        name, rc, cut = line.split()
        out.append((name, None if rc == "-" else int(rc), cut == "1"))
    return out


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'; the results folder's name."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", gpu) if w and w.upper() != "NVIDIA"]
    return words[0].lower() if words else "unknown"


def _today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def _head() -> str:
    r = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return r.stdout.strip() or "unknown"


def _dirty() -> bool:
    r = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    )
    return bool(r.stdout.strip())


# -- command line (run.sh calls these; `plan` is for people) -------------------------------------

MAX_CALL_S = 540  # of the device tool's 600 s per command: the install and the last pack after it
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
    " --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;"
)


def _lines(chosen: list[tuple[dict, int]]) -> str:
    """`NAME RUN EST` per part, for run.sh's loop."""
    return "".join(f"{p['name']} {p['run']} {est}\n" for p, est in chosen)


def plan_text(ledger: dict, head: str, budget_s: int, same_code=git_same_code, root=ROOT) -> str:
    """What `run.sh plan` prints: the parts, their seconds, the wheels and the one device call.
    budget_s: the call's wall time (the lease's device time left, less a cold machine's start of
    a few minutes); one call runs at most 600 s, so at most MAX_CALL_S of it is planned."""
    capped = budget_s > MAX_CALL_S
    budget_s = min(budget_s, MAX_CALL_S)
    deadline = budget_s - ledger.get("install_s", 0)
    ordered = due(ledger, head, same_code, root)
    chosen = choose(ledger, ordered, deadline)
    names = {p["name"] for p, _ in chosen}
    st = dict((p["name"], s) for p, s in ordered)
    out = [f"Lease plan at {head[:12]}: {budget_s} s for the device call, deadline {deadline} s"]
    if capped:
        out.append(
            f"  (one call: at most {MAX_CALL_S} s planned of its 600; plan a second call after)"
        )
    out.append(f"  {'part':<24}{'class':<15}{'status':<9}{'est_s':>6}")
    for p, est in chosen:
        out.append(f"  {p['name']:<24}{p['class']:<15}{st[p['name']]:<9}{est:>6}")
    total = sum(e for _, e in chosen) + ledger.get("overhead_s", 0)
    out.append(f"  total {total} s with {ledger.get('overhead_s', 0)} s of start-up")
    left = [p["name"] for p, _ in ordered if p["name"] not in names]
    if left:
        out.append("Due but not in this budget (next lease): " + ", ".join(left))
    for label, want in (("Absent (no test file yet)", "absent"), ("Current", "current")):
        skipped = [p["name"] for p in ledger["parts"] if status(p, head, same_code, root) == want]
        if skipped:
            out.append(f"{label}: " + ", ".join(skipped))
    wheels = list(ledger.get("extra_wheels", []))
    for p, _ in chosen:
        wheels += [w for w in p.get("wheels", []) if w not in wheels]
    parts = ",".join(p["name"] for p, _ in chosen)
    cmd = (
        f"{INSTALL} LEASE_COMMIT={head} LEASE_PARTS={parts} LEASE_DEADLINE={deadline}"
        " bash benchmarks/gpu/run.sh lease"
    )
    timeout = min(600, budget_s + 60)
    out += [
        "",
        "1. Here, in the project root (adds .whl/):",
        "   ../shared/device/fetch-wheels.sh " + " ".join(wheels),
        f'2. The one device call: run(carry=[".whl"], timeout_s={timeout}, command=',
        f"   {cmd})",
        "3. Then commit $OUT/ledger.json as benchmarks/gpu/ledger.json and the unpacked"
        " results.tgz under benchmarks/results/<gpu>/<date>/ (the ledger's logs name them).",
    ]
    if not parts:
        out.append("Nothing is due: every part ran at this code (or none fits the budget).")
    if len(cmd) > 2000:  # the device tool's limit on one command line
        out.append(f"WARNING: the command is {len(cmd)} characters, over the 2,000 allowed")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["plan", "order", "start", "record", "pytest-args", "slug"])
    ap.add_argument("--ledger", default=os.environ.get("LEDGER") or str(LEDGER))
    ap.add_argument("--head", default=None, help="the commit the lease runs (default: git HEAD)")
    ap.add_argument("--budget", type=int, default=480, help="seconds (plan: the device call)")
    ap.add_argument("--parts", default="", help="order: these parts, in this order")
    ap.add_argument("--part", default=None)
    ap.add_argument("--gpu", default="unknown")
    ap.add_argument("--dry-run", action="store_true", help="start: a CPU dry run (never counts)")
    ap.add_argument("--steps", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("."))
    ap.add_argument("--results-dir", default="benchmarks/results/unknown")
    ap.add_argument("--seconds", type=int, default=None, help="record: the part's wall time")
    a = ap.parse_args(argv)
    ledger = load(a.ledger)
    head = a.head or _head()
    if a.command == "plan":
        if _dirty():
            print("WARNING: the tree has uncommitted changes; commit them, or LEASE_COMMIT lies")
        sys.stdout.write(plan_text(ledger, head, a.budget))
    elif a.command == "order":
        if a.parts:
            ordered = [(part(ledger, n), "asked") for n in a.parts.split(",") if n]
            chosen = choose(ledger, ordered, float("inf"), overhead=False)
        else:  # the lease's start-up is behind it: a.budget is what is left
            chosen = choose(ledger, due(ledger, head), a.budget, overhead=False)
        sys.stdout.write(_lines(chosen))
    elif a.command == "start":
        start(ledger, a.part, head, a.gpu, dry_run=a.dry_run)
        save(ledger, a.ledger)
    elif a.command == "record":
        last = record(ledger, a.part, read_steps(a.steps), a.work, a.results_dir, a.seconds)
        save(ledger, a.ledger)
        print(f"ledger: {a.part} {last['status']} {json.dumps(last['result'])}")
    elif a.command == "pytest-args":
        p = part(ledger, a.part)
        t = p["pytest"]
        args = ["-m", t["marker"]] if t.get("marker") else []
        args += ["@xdist"] if t.get("xdist") else []  # run.sh replaces it when xdist is there
        print(" ".join(args + present_files(p)))
    elif a.command == "slug":
        print(gpu_slug(a.gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
