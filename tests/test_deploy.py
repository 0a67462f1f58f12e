"""Deploy recipes and the example trainer.

The end-to-end test runs what the recipes run: ``examples/train.py`` under two ``torchrun``
agents (``--nnodes 2 --nproc-per-node 2``) meeting through c10d rendezvous on loopback, saving
asynchronously to one moto S3 server; then the job is resumed as one node with three workers.
The two-node job is stopped the way schedulers stop jobs, with SIGTERM to the torchrun agents;
the ranks agree on a step, save it and exit. The resumed job continues exactly: the state
restored on 3 ranks has the same SHA-256 (model and optimizer, gathered, keyed by parameter
name) as the state saved on 4, and the losses of the whole run match an uninterrupted
single-process reference computed here.

The recipe tests parse every manifest and script and check that what they launch exists: the
``torchrun`` command lines parse with torchrun's own parser, the script they start is
``examples/train.py`` (mapped through the Dockerfile for images) and its arguments and
``TRAIN_*`` variables parse with the trainer's parser. The sbatch script is run for real with
stub ``srun``/``scontrol``/``scancel`` commands, including its time-limit requeue path.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml
from torch.distributed.run import get_args_parser

from s3server import S3Location, free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
DEPLOY = REPO / "deploy"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
K8S_JOB = DEPLOY / "kubernetes" / "pytorchjob.yaml"
K8S_SECRET = DEPLOY / "kubernetes" / "secret.example.yaml"
COMPOSE = DEPLOY / "compose" / "docker-compose.yaml"
DOCKERFILE = DEPLOY / "compose" / "Dockerfile"

PREEMPT_AFTER, SAVE_EVERY, KEEP_LAST = 3, 2, 2
PHASE_TIMEOUT_S = 240


def _trainer() -> ModuleType:
    """examples/train.py imported as a module (it runs nothing at import)."""
    name = "shardstore_example_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TRAIN)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _no_pet_env(monkeypatch) -> None:
    """torchrun's parser reads PET_* variables as defaults; keep the caller's out of the checks."""
    for key in list(os.environ):
        if key.startswith(("PET_", "TRAIN_")):
            monkeypatch.delenv(key)


# --- the two-node job on S3, resumed on one node with three workers -----------------------


def _torchrun(nnodes: int, nproc: int, port: int, rdzv_id: str, args: list[str], env: dict, log: Path) -> subprocess.Popen:
    """One torchrun agent ("node") running examples/train.py, rendezvous at 127.0.0.1:port.

    ``--run-path --start-method=fork``: the workers fork from the agent, which has imported
    torch already, instead of starting a fresh interpreter each; on a 2-core CI machine that
    saves about a third of the test's CPU time. Rendezvous, process groups and the trainer are
    the same as in the recipes. Each agent gets its own session, so a hung one is killed with
    its workers.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
        "--run-path", "--start-method=fork",
        str(TRAIN), *args,
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def _logs(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name} ---\n" + log.read_text(errors="replace")[-4000:] for log in logs)


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], what: str, *, check: bool = True) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        raise AssertionError(f"{what}: torchrun did not finish within {PHASE_TIMEOUT_S} s\n{_logs(logs)}")
    codes = [p.returncode for p in procs]
    if check and codes != [0] * len(procs):
        raise AssertionError(f"{what}: torchrun exit codes {codes}\n{_logs(logs)}")


def _wait_for_step(metrics: Path, step: int, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while not (metrics.exists() and any(e["event"] == "step" and e["step"] >= step for e in _events(metrics))):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            raise AssertionError(f"training did not reach step {step}\n{_logs(logs)}")
        time.sleep(0.05)


def _events(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # skip a line being written


def _reference_run(config, steps: int) -> tuple[list[float], torch.nn.Module]:
    """The same training, uninterrupted, in one process without FSDP: losses per step, model."""
    train = _trainer()
    model = train.build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    losses = []
    for step in range(1, steps + 1):
        tokens, targets = train.global_batch(step, config)
        loss = train.loss_fn(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def _after(steps: list[int], keep: int) -> list[int]:
    return sorted(set(steps))[-keep:]


def test_two_nodes_preempted_on_s3_then_one_node_of_three_resumes_exactly(s3_url: S3Location, tmp_path: Path) -> None:
    from shardstore.manager import CheckpointManager, list_checkpoints
    from shardstore.stateful import TrainState

    train = _trainer()
    metrics = tmp_path / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TRAIN_"))}
    # Credentials and endpoint reach the trainer the way the recipes give them: as AWS_*
    # variables (credentials set by the s3_url fixture); the rest as TRAIN_* variables and flags.
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        AWS_ENDPOINT_URL_S3=s3_url.storage_options["endpoint_url"],
        TRAIN_CKPT_ROOT=s3_url.url,
        TRAIN_KEEP_LAST=str(KEEP_LAST),
        TRAIN_DIST_BACKEND="gloo",
        TRAIN_DIM="32", TRAIN_LAYERS="2", TRAIN_HEADS="2", TRAIN_VOCAB="64", TRAIN_SEQ_LEN="16",
        TRAIN_GLOBAL_BATCH="12", TRAIN_LR="0.01",
    )
    args = ["--save-every", str(SAVE_EVERY), "--metrics-file", str(metrics), "--digest"]
    config = train.parse_config(args, environ=env)

    # Phase 1: two "nodes" (torchrun agents), 2 workers each, c10d rendezvous on 127.0.0.1,
    # training towards step 1000 until both agents get SIGTERM (what Kubernetes and Slurm send
    # before they kill a job): torchrun forwards it, the ranks agree at the next step boundary,
    # save that step and exit.
    t0 = time.monotonic()
    port = free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_torchrun(2, 2, port, "phase1", [*args, "--steps", "1000"], env, log) for log in logs]
    _wait_for_step(metrics, PREEMPT_AFTER, nodes, logs)
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    _wait_all(nodes, logs, "two-node phase", check=False)  # a signalled torchrun exits with 1
    t1 = time.monotonic()
    preempted = [e["step"] for e in _events(metrics) if e["event"] == "preempted"]
    assert len(preempted) == 1, _logs(logs)
    stop = preempted[0]
    assert stop >= PREEMPT_AFTER
    saved_before = [*range(SAVE_EVERY, stop + 1, SAVE_EVERY), stop]

    infos = list_checkpoints(s3_url.url, storage_options=s3_url.storage_options)
    assert [(i.step, i.committed, i.world_size) for i in infos] == [(s, True, 4) for s in _after(saved_before, KEEP_LAST)]

    # Phase 2: one node, 3 workers: restores the preemption step resharded from 4 to 3 ranks
    # and trains two more steps.
    total = stop + 2
    log2 = tmp_path / "resume.log"
    _wait_all([_torchrun(1, 3, free_port(), "phase2", [*args, "--steps", str(total)], env, log2)], [log2], "resume phase")
    t2 = time.monotonic()

    events = _events(metrics)
    saves = {e["step"]: e["digest"] for e in events if e["event"] == "save"}
    resumes = [e for e in events if e["event"] == "resume"]
    losses = {}
    for e in events:
        if e["event"] == "step":
            assert e["step"] not in losses, f"step {e['step']} was trained twice"
            losses[e["step"]] = e["loss"]
    saved = sorted({*saved_before, *(s for s in range(stop + 1, total + 1) if s % SAVE_EVERY == 0), total})
    assert sorted(saves) == saved
    assert sorted(losses) == list(range(1, total + 1))
    # The restore is bit-exact: same full model + optimizer state on 3 ranks as saved on 4.
    assert [(r["step"], r["world_size"]) for r in resumes] == [(stop, 3)]
    assert resumes[0]["digest"] == saves[stop]
    assert len(set(saves.values())) == len(saves)  # the digest does change as training goes on

    # The whole run (two jobs, two world sizes) is the uninterrupted run, up to summation order.
    ref_losses, ref_model = _reference_run(config, total)
    got = [losses[s] for s in range(1, total + 1)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    # ...and distinguishable from a run that restarted from scratch after the preemption.
    assert abs(ref_losses[stop] - ref_losses[0]) > 0.05

    infos = list_checkpoints(s3_url.url, storage_options=s3_url.storage_options)
    kept = _after(saved, KEEP_LAST)
    assert [(i.step, i.committed) for i in infos] == [(s, True) for s in kept]
    assert infos[-1].world_size == 3
    assert {k.split("/")[1] for k in s3_url.keys() if k.startswith(f"{s3_url.prefix}/step-")} == {
        f"step-{s:012d}" for s in kept}  # retention deleted the older steps' files too

    # The 3-rank checkpoint of the last step loads in a plain process and equals the reference.
    model = train.build_model(dataclasses.replace(config, seed=config.seed + 1))
    state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=config.lr), counters={"step": 0})
    with CheckpointManager(s3_url.url, storage_options=s3_url.storage_options) as mgr:
        assert mgr.restore({"train": state}) == total
    assert state.counters == {"step": total}
    ref = ref_model.state_dict()
    param_diff = 0.0
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        param_diff = max(param_diff, (tensor - ref[name]).abs().max().item())
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses))
    print(f"two-node phase (preempted after step {stop}) {t1 - t0:.1f} s, resume phase {t2 - t1:.1f} s; "
          f"vs. reference: loss rel. diff <= {loss_diff:.1e}, parameter abs. diff <= {param_diff:.1e}")


def test_trainer_config_from_flags_and_environment(capsys) -> None:
    train = _trainer()
    environ = {"TRAIN_CKPT_ROOT": "s3://b/run", "TRAIN_STEPS": "50", "TRAIN_DIGEST": "true"}
    config = train.parse_config(["--steps", "70", "--s3-endpoint", "http://minio:9000"], environ=environ)
    assert (config.ckpt_root, config.steps, config.digest) == ("s3://b/run", 70, True)  # flag wins
    assert train.storage_options(config) == {"endpoint_url": "http://minio:9000"}
    assert train.storage_options(dataclasses.replace(config, s3_endpoint="")) is None
    for argv, environ, message in [
        ([], {}, "no checkpoint root"),
        (["--ckpt-root", "/x", "--dim", "30", "--heads", "4"], {}, "not divisible by --heads"),
        (["--ckpt-root", "/x"], {"TRAIN_STEPS": "ten"}, "TRAIN_STEPS='ten'"),
        (["--ckpt-root", "/x", "--save-every", "0"], {}, "--save-every must be >= 1"),
        (["--ckpt-root", "/x", "--s3-endpoint", "http://m:9000"], {}, "not an s3:// URL"),
    ]:
        with pytest.raises(SystemExit):
            train.parse_config(argv, environ=environ)
        assert message in capsys.readouterr().err


# --- recipes: they parse, and what they launch exists --------------------------------------


def _assert_console_script(name: str) -> None:
    """``name`` is a command the environment provides: torch's ``torchrun`` or ``shardstore``."""
    scripts = {ep.name for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert name in scripts, f"the recipes run {name!r}, which no installed package provides"


def _torchrun_args(argv: list[str]):
    """Parse a torchrun command line (without the ``torchrun`` word) with torchrun's parser."""
    return get_args_parser().parse_args(argv)


def _dockerfile() -> dict[str, str]:
    """Image path -> repository path of everything the Dockerfile's COPY lines put in the image."""
    workdir, copies = "/", {}
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if not words:
            continue
        if words[0] == "WORKDIR":
            workdir = os.path.join(workdir, words[1])
        elif words[0] == "COPY":
            assert not any(w.startswith("--from") for w in words), line
            *sources, dest = words[1:]
            dest = os.path.join(workdir, dest)
            into_dir = dest.endswith(("/", "/.")) or len(sources) > 1
            for src in sources:
                copies[os.path.normpath(os.path.join(dest, os.path.basename(src)) if into_dir else dest)] = src
    return copies


def _repo_path_of_image_path(image_path: str) -> Path:
    """Where ``image_path`` (a file in the trainer image) comes from in this repository."""
    for dest, src in _dockerfile().items():
        if image_path == dest or image_path.startswith(dest + "/"):
            return REPO / src / os.path.relpath(image_path, dest)
    raise AssertionError(f"{image_path} is not copied into the image by {DOCKERFILE}")


def test_yaml_files_load() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert {f.relative_to(DEPLOY).as_posix() for f in files} >= {
        "kubernetes/pytorchjob.yaml", "kubernetes/secret.example.yaml", "compose/docker-compose.yaml"}
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), f


def test_dockerfile_pins_this_torch_and_copies_what_exists() -> None:
    text = DOCKERFILE.read_text()
    pins = re.findall(r"torch==([\w.]+)", text)
    assert pins == [torch.__version__.split("+")[0]]  # the torch this repo is tested with
    assert "download.pytorch.org/whl/cpu" in text
    for dest, src in _dockerfile().items():
        assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
    assert _repo_path_of_image_path("/app/examples/train.py") == TRAIN


def test_kubernetes_pytorchjob_launches_the_trainer(monkeypatch) -> None:
    _no_pet_env(monkeypatch)
    docs = {d["kind"]: d for d in yaml.safe_load_all(K8S_JOB.read_text())}
    secret = yaml.safe_load(K8S_SECRET.read_text())
    job, config_map = docs["PyTorchJob"], docs["ConfigMap"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    elastic = spec["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    assert worker["restartPolicy"] in ("OnFailure", "ExitCode")
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "pytorch"  # the operator finds the rendezvous port in this one
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["pytorchjob-port"] == elastic["rdzvPort"]

    # Environment: the ConfigMap and the Secret the pods read exist and carry what is needed.
    refs = container["envFrom"]
    assert {"configMapRef": {"name": config_map["metadata"]["name"]}} in refs
    assert {"secretRef": {"name": secret["metadata"]["name"]}} in refs
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secret["stringData"])
    environ = {k: str(v) for k, v in config_map["data"].items()}
    assert environ["TRAIN_CKPT_ROOT"].startswith("s3://")

    # The command: torchrun (settings from the operator's PET_* variables) starting train.py.
    command = container["command"] + container.get("args", [])
    assert command[0] == "torchrun"
    _assert_console_script(command[0])
    launch = _torchrun_args(command[1:])
    assert _repo_path_of_image_path(launch.training_script) == TRAIN
    config = _trainer().parse_config(launch.training_script_args, environ=environ)
    assert environ["AWS_ENDPOINT_URL_S3"].startswith("http")  # MinIO; the comment says: delete for AWS
    world = worker["replicas"] * int(spec["nprocPerNode"])
    assert config.global_batch % world == 0
    # SIGTERM reaches torchrun, which gives the workers time to save before the pod is killed.
    assert launch.shutdown_timeout < worker["template"]["spec"]["terminationGracePeriodSeconds"]


def test_compose_runs_minio_a_bucket_and_two_nodes(monkeypatch) -> None:
    _no_pet_env(monkeypatch)
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"minio", "create-bucket", "node0", "node1"} <= set(services)
    assert services["create-bucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    bucket_cmd = services["create-bucket"]["command"]
    assert bucket_cmd[0] == "mb"
    created_bucket = bucket_cmd[-1].split("/", 1)[1]
    trainers = [n for n in services if n.startswith("node")]
    for name in trainers:
        svc = services[name]
        assert svc["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
        build = svc["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE.resolve()
        command = svc["command"]
        assert command[0] == "torchrun"
        _assert_console_script(command[0])
        launch = _torchrun_args(command[1:])
        assert launch.rdzv_backend == "c10d"
        assert launch.nnodes == str(len(trainers))
        host = launch.rdzv_endpoint.split(":")[0]
        assert services[host]["hostname"] == host  # the rendezvous host is a node of the job
        assert _repo_path_of_image_path(launch.training_script) == TRAIN
        environ = {k: str(v) for k, v in svc["environment"].items()}
        config = _trainer().parse_config(launch.training_script_args, environ=environ)
        assert config.ckpt_root.startswith(f"s3://{created_bucket}/")
        assert environ["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
        assert services["minio"]["ports"][0].split(":")[-1] == "9000"
        assert config.global_batch % (len(trainers) * int(launch.nproc_per_node)) == 0
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(environ)


_STUBS = {
    # srun: record argv and the environment the tasks would get, then run like a job step.
    "srun": """#!/usr/bin/env python3
import json, os, sys, time
out = os.environ["STUB_DIR"]
json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, open(os.path.join(out, "srun.json"), "w"))
open(os.path.join(out, "srun.pid"), "w").write(str(os.getpid()))
time.sleep(float(os.environ.get("STUB_SRUN_SECONDS", "0")))
""",
    "scontrol": """#!/bin/sh
echo "scontrol $*" >> "$STUB_DIR/calls"
if [ "$1 $2" = "show hostnames" ]; then printf 'gpu-node-17\\ngpu-node-18\\n'; fi
""",
    # scancel --signal=TERM: the step's tasks get SIGTERM; here the stub srun just ends.
    "scancel": """#!/bin/sh
echo "scancel $*" >> "$STUB_DIR/calls"
kill -TERM "$(cat "$STUB_DIR/srun.pid")"
""",
}


def _slurm_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in _STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TRAIN_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", STUB_DIR=str(tmp_path),
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="shardstore-train", SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="gpu-node-[17-18]", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(REPO),
        SLURM_RESTART_COUNT="1",
    )
    return env


def test_sbatch_script_parses_and_launches_the_trainer(tmp_path: Path, monkeypatch) -> None:
    _no_pet_env(monkeypatch)
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "--requeue" in directives and "--ntasks-per-node=1" in directives
    assert any(d.startswith("--signal=B:USR1@") for d in directives)

    env = _slurm_env(tmp_path)
    proc = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    srun = json.loads((tmp_path / "srun.json").read_text())
    argv = srun["argv"]
    launcher = argv.index("torchrun")
    _assert_console_script("torchrun")
    assert "--ntasks-per-node=1" in argv[:launcher]
    launch = _torchrun_args(argv[launcher + 1:])
    assert launch.rdzv_backend == "c10d"
    assert launch.rdzv_endpoint == "gpu-node-17:29400"  # the first node of the allocation
    assert launch.rdzv_id == "4242-1"
    assert (launch.nnodes, launch.nproc_per_node) == ("2", "8")
    assert Path(launch.training_script) == TRAIN
    config = _trainer().parse_config(launch.training_script_args, environ=srun["env"])
    assert config.ckpt_root == "/shared/checkpoints/shardstore-train"
    # An S3 root from the submitting environment reaches the trainer.
    env["TRAIN_CKPT_ROOT"] = "s3://bucket/run1"
    subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, check=True, timeout=60)
    srun = json.loads((tmp_path / "srun.json").read_text())
    assert _trainer().parse_config([], environ=srun["env"]).ckpt_root == "s3://bucket/run1"
    assert "requeue" not in (tmp_path / "calls").read_text()


def test_sbatch_requeues_after_the_time_limit_warning(tmp_path: Path) -> None:
    env = _slurm_env(tmp_path)
    env["STUB_SRUN_SECONDS"] = "60"
    proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun.pid").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@180 sends
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[-2:] == ["scancel --signal=TERM 4242", "scontrol requeue 4242"]


def _shell_commands(text: str) -> list[list[str]]:
    """The command lines (as words) of the bash/sh code blocks of a Markdown text."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def test_docs_commands_exist_and_parse(monkeypatch) -> None:
    """Each command line in docs/deploy.md names files that exist and parses where we can parse it:
    torchrun (its own parser, then the trainer's), the shardstore CLI (its own parser)."""
    from shardstore.cli import build_parser as shardstore_parser

    _no_pet_env(monkeypatch)
    commands = _shell_commands((REPO / "docs" / "deploy.md").read_text())
    seen = set()
    for words in commands:
        for word in words:
            if re.match(r"^(deploy|examples|docs)/", word):
                assert (REPO / word).exists(), f"docs/deploy.md names {word}, which does not exist"
        if "torchrun" in words:
            seen.add("torchrun")
            _assert_console_script("torchrun")
            launch = _torchrun_args(words[words.index("torchrun") + 1:])
            script = launch.training_script
            path = _repo_path_of_image_path(script) if script.startswith("/app/") else REPO / script
            assert path == TRAIN
            _trainer().parse_config(launch.training_script_args, environ={"TRAIN_CKPT_ROOT": "/tmp/x"})
        if "shardstore" in words:
            seen.add("shardstore")
            _assert_console_script("shardstore")
            argv = words[words.index("shardstore") + 1:]
            shardstore_parser().parse_args(argv)  # exits (fails the test) on an unknown verb/option
    assert seen == {"torchrun", "shardstore"}
