"""pytest plugin for tools/upstream_tests.py: per-rank results, a hang watchdog, side checks.

``tools/upstream_tests.py prepare`` copies this file into both run roots of the bundle
(``pristine/`` and ``patched/``) as ``r3_upstream_plugin.py``; ``run`` loads it with
``-p r3_upstream_plugin`` in every torchrun rank. It

* checks that ``megatron.core`` is imported from the run root (the side under test) and
  prints its file and version;
* writes one JSON line per test event to ``<results>/rank<RANK>.jsonl`` as it happens
  (``start`` before a test, ``end`` with its outcome and seconds after it), so a run that is
  killed or hangs still says which test it was in, and ``terminated`` when torchrun stops the
  rank because another one died (its test was not the one that killed the run);
* writes the collected test ids (rank 0) to ``<results>/collected-<attempt>.json``;
* deselects the test ids listed in ``--r3-skip`` (tests that finished or hung in an earlier
  attempt of the same side);
* runs a watchdog: a test still running ``--r3-hard-timeout`` seconds after it started (a hang
  in a collective or a device wait, which pytest-timeout's signal cannot interrupt) is
  recorded as ``timeout``, the stacks of all threads go to stderr, and the rank exits; torchrun
  then stops the other ranks and the runner starts the next attempt after that test.

No Megatron code is imported before the tests import it, except in pytest_configure's check.
"""

import faulthandler
import json
import math
import os
import signal
import sys
import threading
import time

import pytest

# Reentrant: the SIGTERM handler writes from the main thread, which the signal may catch inside a write of its own.
_STATE = {"file": None, "lock": threading.RLock(), "timer": None, "current": None}


def pytest_addoption(parser):
    group = parser.getgroup("r3-upstream", "megatron-r3 upstream-test runner")
    group.addoption("--r3-results", default=None, help="folder for the per-rank JSON lines")
    group.addoption("--r3-side", default="?", help="name of the side under test")
    group.addoption("--r3-attempt", type=int, default=0, help="attempt number of this side")
    group.addoption("--r3-skip", default=None, help="file of test ids to deselect, one a line")
    group.addoption(
        "--r3-fit-world", action="store_true",
        help="deselect tests whose parallel sizes the world cannot hold (see ranks_needed)",
    )
    group.addoption(
        "--r3-hard-timeout", type=float, default=0.0,
        help="seconds after which a test still running ends the rank (0: no watchdog)",
    )


def _rank():
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _emit(record):
    handle = _STATE["file"]
    if handle is None:
        return
    record = dict(record, rank=_rank(), t=round(time.time(), 3))
    with _STATE["lock"]:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@pytest.hookimpl(tryfirst=True)  # before junitxml reads the --junitxml path
def pytest_configure(config):
    results = config.getoption("--r3-results")
    rank = _rank()
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and "{rank}" in xmlpath:
        config.option.xmlpath = xmlpath.replace("{rank}", str(rank))
    root = os.path.realpath(os.getcwd())
    import megatron.core  # the side under test: must come from the run root
    from megatron.core import package_info

    core_file = os.path.realpath(megatron.core.__file__)
    line = (
        f"[r3-upstream] side={config.getoption('--r3-side')} rank={rank} "
        f"megatron.core={core_file} version={package_info.__version__}"
    )
    sys.__stderr__.write(line + "\n")
    sys.__stderr__.flush()
    if results:
        os.makedirs(results, exist_ok=True)
        _STATE["file"] = open(os.path.join(results, f"rank{rank}.jsonl"), "a")
        signal.signal(signal.SIGTERM, _terminated)
        _emit({
            "event": "session", "attempt": config.getoption("--r3-attempt"),
            "core_file": core_file, "version": package_info.__version__, "root": root,
        })
    if not core_file.startswith(root + os.sep):
        pytest.exit(
            f"megatron.core was imported from {core_file}, not from the run root {root}: "
            "another megatron is earlier on sys.path (PYTHONPATH? an editable install?)",
            returncode=4,
        )


# Parallel sizes as Megatron's tests name them in their parameters.
SIZE_PARAMS = {
    "tp_size": "tp", "tensor_model_parallel_size": "tp", "pp_size": "pp",
    "pipeline_model_parallel_size": "pp", "cp_size": "cp", "context_parallel_size": "cp",
    "ep_size": "ep", "expert_model_parallel_size": "ep", "etp_size": "etp", "moe_tp_size": "etp",
    "expert_tensor_parallel_size": "etp",
}


# Tuple-valued sizes, named by their parts: tp_pp_ep (2, 2, 1); src_/dest_ for a checkpoint's two layouts.
TUPLE_SIZE_PARTS = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "exp": "ep", "etp": "etp"}


def _layouts(params):
    """The parallel layouts a test's parameters name: one of its scalar sizes (tp_size, ...), and
    one per tuple of sizes (tp_pp_ep=(2, 2, 1), src_tp_pp=(2, 4), dest_tp_pp_ep_etp=(...))."""
    scalar = {SIZE_PARAMS[name]: value for name, value in params.items()
              if name in SIZE_PARAMS and isinstance(value, int) and value > 0}
    layouts = [scalar] if scalar else []
    for name, value in params.items():
        parts = name.removeprefix("src_").removeprefix("dest_").split("_")
        if (len(parts) > 1 and all(part in TUPLE_SIZE_PARTS for part in parts)
                and isinstance(value, (tuple, list)) and len(value) == len(parts)
                and all(isinstance(size, int) and size > 0 for size in value)):
            layouts.append({TUPLE_SIZE_PARTS[part]: size for part, size in zip(parts, value)})
    return layouts


def ranks_needed(params):
    """The smallest world that every layout a test's parameters name fits, or None if they name none.

    Megatron needs the world divisible by tp*pp*cp and by etp*ep*pp (etp defaults to tp).
    A test asking for more raises in its setup on every rank, and upstream's MoE test
    container then runs a world barrier from its finalizer whenever each rank's garbage
    collector frees it: the ranks' barriers pair across tests and they deadlock.
    """
    layouts = _layouts(params)
    if not layouts:
        return None
    needed = 1
    for sizes in layouts:
        tp, pp, cp = sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("cp", 1)
        expert = sizes.get("etp", tp) * sizes.get("ep", 1) * pp
        needed = math.lcm(needed, tp * pp * cp, expert)
    return needed


def pytest_collection_modifyitems(session, config, items):
    if config.getoption("--r3-fit-world"):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        too_big = [item for item in items if world % (ranks_needed(
            getattr(getattr(item, "callspec", None), "params", {})) or 1) != 0]
        if too_big:
            config.hook.pytest_deselected(items=too_big)
            dropped = {id(item) for item in too_big}
            items[:] = [item for item in items if id(item) not in dropped]
            _emit({"event": "deselected_for_world", "world": world,
                   "nodeids": [item.nodeid for item in too_big]})
    skip_file = config.getoption("--r3-skip")
    if skip_file and os.path.exists(skip_file):
        with open(skip_file) as handle:
            skip = {line.strip() for line in handle if line.strip()}
        kept = [item for item in items if item.nodeid not in skip]
        dropped = [item for item in items if item.nodeid in skip]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    results = config.getoption("--r3-results")
    if results and _rank() == 0:
        path = os.path.join(results, f"collected-{config.getoption('--r3-attempt')}.json")
        with open(path + ".tmp", "w") as handle:
            json.dump([item.nodeid for item in items], handle)
        os.replace(path + ".tmp", path)


def _terminated(signum, frame):
    """torchrun stops the other ranks when one dies: said, so the test this rank was in is not taken for
    the one that killed it; then the signal's default action ends the rank."""
    _emit({"event": "terminated"})
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _watchdog_fired(nodeid, seconds):
    _emit({"event": "end", "nodeid": nodeid, "outcome": "timeout", "seconds": seconds})
    header = (
        f"\n[r3-upstream] rank {_rank()}: {nodeid} still running after {seconds:.0f} s; "
        "stacks of all threads follow, then this rank exits\n"
    )
    config = _STATE.get("config")
    results = config.getoption("--r3-results") if config is not None else None
    if results:  # the stacks in a file: pytest's output capture may hold stderr
        attempt = config.getoption("--r3-attempt")
        path = os.path.join(results, f"timeout-rank{_rank()}-attempt{attempt}.txt")
        with open(path, "w") as handle:
            handle.write(header)
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
    try:  # and on the terminal, as pytest-timeout does it
        capman = config.pluginmanager.getplugin("capturemanager")
        capman.suspend_global_capture(in_=True)
    except Exception:
        pass
    sys.__stderr__.write(header)
    sys.__stderr__.flush()
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    sys.__stderr__.flush()
    os._exit(3)


def pytest_collectreport(report):
    # A file that fails to import adds no test ids: without this its error is seen nowhere
    # but in the side's own log, and the two sides' test counts differ unexplained.
    if report.failed:
        message = getattr(report.longrepr, "longrepr", None) or str(report.longrepr)
        _emit({"event": "collect_error", "nodeid": report.nodeid,
               "message": str(message).strip().splitlines()[-1][:500]})


def pytest_runtest_logstart(nodeid, location):
    _STATE["current"] = {"nodeid": nodeid, "start": time.monotonic(), "phases": {}}
    _emit({"event": "start", "nodeid": nodeid})
    config = _STATE.get("config")
    limit = config.getoption("--r3-hard-timeout") if config is not None else 0.0
    if limit and limit > 0:
        timer = threading.Timer(limit, _watchdog_fired, args=(nodeid, limit))
        timer.daemon = True
        timer.start()
        _STATE["timer"] = timer


def pytest_sessionstart(session):
    _STATE["config"] = session.config


def pytest_runtest_logreport(report):
    current = _STATE["current"]
    if current is None or current["nodeid"] != report.nodeid:
        return
    if report.when == "setup":
        if report.failed:
            outcome = "error"
        elif report.skipped:
            outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        else:
            outcome = None
        if outcome:
            current["outcome"] = outcome
    elif report.when == "call":
        if hasattr(report, "wasxfail"):
            current["outcome"] = "xfailed" if report.skipped else "xpassed"
        elif report.failed:
            current["outcome"] = "failed"
        elif report.skipped:
            current["outcome"] = "skipped"
        else:
            current["outcome"] = "passed"
        if report.failed:
            current["message"] = _short(report)
    elif report.when == "teardown" and report.failed:
        if current.get("outcome") in (None, "passed"):
            current["outcome"] = "error"
            current["message"] = _short(report)
    if report.failed and report.when == "setup":
        current["message"] = _short(report)
    if report.skipped and report.when in ("setup", "call") and "message" not in current:
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            current["message"] = str(longrepr[2])[:300]


def _short(report):
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return " | ".join((errors or lines[-1:])[:3])[:500]


def pytest_runtest_logfinish(nodeid, location):
    timer = _STATE.pop("timer", None)
    if timer is not None:
        timer.cancel()
    current = _STATE["current"]
    _STATE["current"] = None
    if current is None or current["nodeid"] != nodeid:
        return
    record = {
        "event": "end", "nodeid": nodeid, "outcome": current.get("outcome", "passed"),
        "seconds": round(time.monotonic() - current["start"], 3),
    }
    if current.get("message"):
        record["message"] = current["message"]
    _emit(record)


def pytest_sessionfinish(session, exitstatus):
    _emit({"event": "session_end", "exitstatus": int(exitstatus)})
