"""Workdirs and corpora in an object store (`parallax/remote.py`), against a real S3 server: moto's server mode,
started by this module on 127.0.0.1 and stopped after it; the clients are told no other address (the
endpoint, fake keys, no instance-metadata lookups).

The journey a user takes on a cloud machine: prepare a corpus to `s3://`, train with `--workdir=s3://...`,
the machine dies (SIGKILL) and its disk with it (the local copy wiped), rerun the same command on "another
machine", and sample, all from the bucket; each step's loss is the one of an uninterrupted local run. Bad
inputs (a missing bucket, no credentials) are one line before anything is written.
"""

import os
import shutil
import socket
import subprocess
import time

import pytest

from helpers import ROOT, launcher_command, read_metrics, run_launcher, tiny_config

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

# Real processes with deadlines: run alone, after the parallel part of `make test`.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server's endpoint in the environment (for this process and the launchers it starts), a bucket
    `runs`, and the local copies under a fresh PARALLAX_CACHE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_EC2_METADATA_DISABLED="true",
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull,
               PARALLAX_CACHE=str(tmp_path_factory.mktemp("cache")))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="runs")
    try:
        yield client
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def _keys(client, prefix=""):
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket="runs", Prefix=prefix).get("Contents", []))


FLAGS = ["--config=configs/tiny.py", "--workdir=s3://runs/run", "--cpu_devices=2", "--config.mesh.data=2",
         "--config.data.source=tokens", "--config.data.path=s3://runs/corpus", "--config.model.vocab_size=0",
         "--config.train.log_every=1", "--config.train.checkpoint_every=3", "--config.train.eval_every=0",
         "--config.optim.decay_steps=100000"]


def test_prepare_train_kill_lose_the_disk_resume_and_sample_all_in_a_bucket(s3, tmp_path):
    from parallax import remote
    from parallax.train import train_and_evaluate

    prep = run_launcher("prepare_data", f"--inputs={ROOT}/docs/*.md", "--output=s3://runs/corpus", "--noprogress",
                        timeout=120)
    assert prep.returncode == 0, prep.stderr[-2000:]
    assert "runs/corpus/manifest.json" in [f"runs/{k}" for k in _keys(s3, "corpus/")]

    proc = subprocess.Popen(launcher_command("train", *FLAGS, "--config.train.steps=100000"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # killed once a checkpoint is complete in the bucket (its marker uploaded)
        deadline = time.time() + 180
        while time.time() < deadline and not [k for k in _keys(s3, "run/checkpoints/") if k.endswith(remote.MARKER)]:
            assert proc.poll() is None, "the run ended before it was killed"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    uploaded = sorted({int(k.split("/")[2]) for k in _keys(s3, "run/checkpoints/") if k.endswith(remote.MARKER)})
    assert uploaded, _keys(s3)
    shutil.rmtree(remote.local_path("s3://runs"))  # the machine is gone, and its disk: corpus and run copies

    steps = uploaded[-1] + 3  # the killed run went further; the rerun trains 3 steps past the bucket's newest
    rerun = run_launcher("train", *FLAGS, f"--config.train.steps={steps}", timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"downloaded checkpoint step {uploaded[-1]} from s3://runs/run" in rerun.stdout, rerun.stdout[-2000:]
    assert f"at step {uploaded[-1]}\n" in rerun.stdout
    assert f"run/checkpoints/{steps}/{remote.MARKER}" in _keys(s3, "run/checkpoints/")  # the last step, uploaded
    assert {"run/config.json", "run/metrics.jsonl", "run/goodput.json"} <= set(_keys(s3, "run/"))

    shutil.rmtree(remote.local_path("s3://runs"))  # sampling on yet another machine (launch/sample.py's function)
    from parallax.sample import sample_from_workdir

    assert sample_from_workdir("s3://runs/run", "The ", num_tokens=4).startswith(f"step {steps} sample")

    logged = read_metrics(remote.local_path("s3://runs/run"))  # the bucket's metrics.jsonl, pulled by sample
    config = tiny_config(data=2)
    config.data.update(source="tokens", path="s3://runs/corpus")
    config.model.vocab_size = 0
    config.train.update(steps=steps, log_every=1, checkpoint_every=0, eval_every=0)
    config.optim.decay_steps = 100000
    import jax

    reference = train_and_evaluate(config, str(tmp_path / "local"), devices=jax.devices()[:2], log=lambda *_: None)
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    assert [r["loss"] for r in logged] == [r["loss"] for r in reference.history]


def test_a_missing_bucket_or_credentials_is_one_line_before_anything_is_written(s3, tmp_path):
    from parallax import remote
    from parallax.errors import ConfigError

    before = _keys(s3)
    out = run_launcher("train", *[f.replace("s3://runs/run", "s3://no-such-bucket/run") for f in FLAGS], timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "config error: --workdir=s3://no-such-bucket/run: bucket 'no-such-bucket' does not exist (or these "
        "credentials cannot see it); create it or fix the URL"], out.stderr
    assert not os.path.exists(remote.local_path("s3://no-such-bucket"))
    out = run_launcher("prepare_data", f"--inputs={ROOT}/README.md", "--output=s3://no-such-bucket/corpus",
                       timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "config error: --output=s3://no-such-bucket/corpus: bucket 'no-such-bucket' does not exist (or these "
        "credentials cannot see it); create it or fix the URL"], out.stderr
    from parallax.sample import sample_from_workdir

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        with pytest.raises(ConfigError, match=r"^--workdir=s3://runs/run: no credentials for s3:// "
                                              r"\(NoCredentialsError\); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
            sample_from_workdir("s3://runs/run", "The ")
    with pytest.raises(ConfigError, match=r"config.data.path=s3://runs/nothing-here: nothing there; prepare"):
        remote.localize_paths("s3://runs/nothing-here", "config.data.path")
    with pytest.raises(ConfigError, match=r"--workdir=ftp://x/y: only gs:// and s3:// URLs"):
        remote.filesystem("ftp://x/y", "--workdir")
    assert _keys(s3) == before
