"""Config and start-up cost.

1. compose + validate, in this process, of every shipped recipe (with the overrides of its first-line command):
   Hydra compose API after `molt_hydra.config.store.register()`, then `molt_hydra.cli.to_run_config` and
   `molt_hydra.runtime.validate.validate`. Reported for the largest recipe (most resolved config lines): the cold
   call (initialize_config_dir + first compose, as `molt-run` pays it) and the median of warm calls. Goal < 1 s.
   Baseline: `import molt_hydra.config.schema` (the typed schema import, which any run pays anyway).
2. `molt-run` (the embedded default) from launch to the first generated token. Method: the run uses the toy Env
   with wall-clock stamps (bench/agents/stamp_toy.py, `agent.runner._target_` override, nothing else changed):
   `first_request` = the first episode's reset (its prompt goes to the engine next), `first_response` = the first
   finished response (8 tokens) reaching `Env.step`. The first token lies between the two (the 7 more decode
   steps of the tiny model take milliseconds). Also: launch -> first line of metrics.jsonl (first trained step),
   and the plan printed (config done). Baseline: `python -c "import molt_hydra.cli"` (interpreter + imports).
   The profile: the run's own start-up line (runtime/roles.py: seconds from Ray's start until Ray, the trainer,
   the agent runners and the engines are each ready; they start at once) and when that line was printed; and the
   CPU seconds every process of the run used until the first request (psutil, sampled every 0.25 s): the work that
   start-up is, which a shared machine stretches in time but does not change. On an idle 2-core machine the first
   token cannot come before (that work) / 2.

    flock /tmp/molt_heavy.lock .venv/bin/python bench/startup_cost.py [--launches 2]
"""

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, append_row, role_of  # noqa: E402

PY = Path(sys.executable)
MOLT_RUN = PY.with_name("molt-run")


def recipe_overrides():
    from molt_hydra.config.store import RECIPES_DIR

    out = {}
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        argv = shlex.split(path.read_text().splitlines()[0].lstrip("#"))[1:]
        out[path.stem] = [a for a in argv if not a.startswith("-")]
    return out


def compose_cost():
    t0 = time.perf_counter()
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from molt_hydra.cli import to_run_config
    from molt_hydra.config.store import CONF_DIR, register
    from molt_hydra.runtime.validate import validate
    import_s = time.perf_counter() - t0

    def once(overrides, init):
        t = time.perf_counter()
        if init:
            register()
            GlobalHydra.instance().clear()
            initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
        cfg = compose("config", overrides=[*overrides, "output_dir=/tmp/molt_bench_compose"])
        validate(to_run_config(cfg))
        return time.perf_counter() - t, len(OmegaConf.to_yaml(cfg).splitlines())

    results = {}
    first = True
    for name, overrides in recipe_overrides().items():
        if any("," in o for o in overrides):  # sweep recipes: compose the first point
            overrides = [o.split(",")[0] for o in overrides]
        try:
            cold, lines = once(overrides, init=first)
        except Exception as e:  # noqa: BLE001 - report, do not hide
            print(f"  {name}: compose/validate failed: {str(e).splitlines()[0]}")
            continue
        first = False
        warm = statistics.median(once(overrides, init=False)[0] for _ in range(5))
        results[name] = (cold, warm, lines)
        print(f"  {name}: {lines} lines, first {cold * 1000:.0f} ms, warm median {warm * 1000:.0f} ms")
    largest = max(results, key=lambda n: results[n][2])
    # the cold cost of the largest recipe alone, in a fresh interpreter (what `molt-run +recipe=X` pays)
    code = (
        "import time; t=time.perf_counter();"
        "from hydra import compose, initialize_config_dir;"
        "from molt_hydra.cli import to_run_config;"
        "from molt_hydra.config.store import CONF_DIR, register;"
        "from molt_hydra.runtime.validate import validate;"
        "t1=time.perf_counter(); register(); initialize_config_dir(config_dir=str(CONF_DIR), version_base='1.3');"
        "validate(to_run_config(compose('config', "
        f"overrides={recipe_overrides()[largest] + ['output_dir=/tmp/x']!r})));"
        "print(t1-t, time.perf_counter()-t1)")
    imp, fresh = map(float, subprocess.run([str(PY), "-c", code], capture_output=True, text=True, cwd=REPO,
                                           check=True).stdout.split())
    base = float(subprocess.run([str(PY), "-c", "import time; t=time.perf_counter(); "
                                 "import molt_hydra.config.schema; print(time.perf_counter()-t)"],
                                capture_output=True, text=True, cwd=REPO, check=True).stdout)
    return largest, results[largest], import_s, imp, fresh, base


def role_with_core_server(proc, driver_pid: int) -> str:
    """_common.role_of, and the engine core's forkserver (compat/vllm.py: core_launch): its vLLM import."""
    if "multiprocessing.forkserver import main" in " ".join(proc.cmdline()[:4]):
        return "engine core server"
    return role_of(proc, driver_pid)


def launch_cost(launches, overrides=()):
    rows = []
    for i in range(launches):
        stamps = tempfile.mkdtemp(prefix="molt_bench_stamps_")
        out = tempfile.mkdtemp(prefix="molt_bench_run_")
        args = [str(MOLT_RUN), f"hydra.run.dir={out}", "train.max_steps=2", "logger.wandb.mode=disabled",
                f"agent.runner._target_={REPO}/bench/agents/stamp_toy.py:StampToyEnv",
                f"+agent.runner.stamp_dir={stamps}", *overrides]
        metrics = Path(out) / "metrics.jsonl"
        seen = {}

        def watch():  # when the first training step's metrics line appears
            while "t" not in seen and not seen.get("stop"):
                if metrics.exists() and metrics.stat().st_size > 0:
                    seen["t"] = time.time()
                time.sleep(0.05)

        def cpu_until_first_request(pid):
            import psutil

            root, last = psutil.Process(pid), {}
            while not Path(stamps, "first_request").exists() and not seen.get("stop"):
                try:
                    for p in [root, *root.children(recursive=True)]:
                        try:
                            t = p.cpu_times()  # exited processes keep their last value
                            last[p.pid] = (role_with_core_server(p, pid), t.user + t.system)
                        except (psutil.NoSuchProcess, psutil.ZombieProcess):
                            pass
                except psutil.NoSuchProcess:
                    break
                seen["cpu"] = sum(c for _, c in last.values())
                by_role = {}
                for role, c in last.values():
                    by_role[role] = by_role.get(role, 0.0) + c
                seen["by_role"] = ", ".join(f"{r} {c:.1f}" for r, c in sorted(by_role.items(), key=lambda x: -x[1]))
                time.sleep(0.25)

        watcher = threading.Thread(target=watch, daemon=True)
        t0 = time.time()
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watcher.start()
        cpu_watcher = threading.Thread(target=cpu_until_first_request, args=(proc.pid,), daemon=True)
        cpu_watcher.start()
        plan_at = roles_at = None
        profile = ""
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if plan_at is None and "Plan" in line:
                plan_at = time.time() - t0
            if roles_at is None and line.startswith("start-up,"):
                roles_at, profile = time.time() - t0, line.split(":", 1)[1].strip()
        rc = proc.wait()
        if rc != 0:
            raise RuntimeError("molt-run failed:\n" + "".join(lines[-40:]))
        seen["stop"] = True
        watcher.join()
        cpu_watcher.join()
        first_metric = seen.get("t", float("nan")) - t0
        req = float(Path(stamps, "first_request").read_text()) - t0
        resp = float(Path(stamps, "first_response").read_text()) - t0
        cpu = seen.get("cpu", float("nan"))
        profile += f"; CPU s by role until the first request: {seen.get('by_role', '')}"
        rows.append((plan_at or float("nan"), req, resp, first_metric, roles_at or float("nan"), profile, cpu))
        print(f"  launch {i}: plan printed {plan_at:.1f} s, roles ready {rows[-1][4]:.1f} s ({profile}), first request "
              f"{req:.1f} s ({cpu:.1f} CPU s), first response {resp:.1f} s")
    base = []
    for _ in range(2):
        t = time.time()
        subprocess.run([str(PY), "-c", "import molt_hydra.cli"], cwd=REPO, check=True)
        base.append(time.time() - t)
    return rows, min(base)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launches", type=int, default=2)
    p.add_argument("--skip-launch", action="store_true")
    p.add_argument("--override", action="append", default=[], help="a molt-run override for the launches")
    args, _ = p.parse_known_args()  # --no-append is read by _common.append_row
    largest, (cold, warm, lines), _, imp, fresh, base = compose_cost()
    append_row("config_cost", f"compose+validate of the largest recipe `{largest}` ({lines} resolved lines), "
               "in-process Hydra compose API", f"import molt_hydra.config.schema {base * 1000:.0f} ms",
               f"fresh interpreter: imports {imp * 1000:.0f} ms + register/init/compose/validate {fresh * 1000:.0f} ms;"
               f" warm compose+validate {warm * 1000:.0f} ms",
               f"compose+validate {fresh:.2f} s cold / {warm:.3f} s warm (goal < 1 s)")
    if args.skip_launch:
        return
    rows, py_base = launch_cost(args.launches, args.override)
    best = min(rows, key=lambda r: r[2])
    append_row("startup_cost", f"`molt-run` default recipe (tiny Qwen3, toy task), launch -> first token measured "
               f"with Env stamps (bench/agents/stamp_toy.py), best of {len(rows)}"
               + "".join(f", {o}" for o in args.override),
               f"python -c 'import molt_hydra.cli' {py_base:.1f} s",
               f"plan printed {best[0]:.1f} s; roles ready {best[4]:.1f} s (from Ray's start: {best[5]}); first "
               f"request {best[1]:.1f} s after {best[6]:.1f} CPU s of all the run's processes (least of the launches "
               f"{min(r[6] for r in rows):.1f}); first response (8 tok) {best[2]:.1f} s; first step logged "
               f"{best[3]:.1f} s",
               f"first token in [{best[1]:.1f}, {best[2]:.1f}] s after launch (goal <= 20 s)",
               note="load avg at the end " + " ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
