"""TensorBoard as the user sees it: a tiny threshold and a tiny softmax ``lit_thresh fit`` into one log root,
the real ``tensorboard`` server started on it (localhost, a free port), and what its HTTP API serves the
dashboards read back: runs, scalar tags and values, HPARAMS, and an attention image."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slow  # runs the lit_thresh command and the tensorboard server

QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
RUNS = {  # run name -> attention class
    "threshold": "lit_thresh.attention.ThresholdAttention",
    "softmax": "lit_thresh.attention.SoftmaxAttention",
}
SEQ_LEN = 32
# The quickstart, shrunk to one epoch of 2 steps on CPU.
TINY = [
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=1",
    f"--data.init_args.train=[{{seq_len: {SEQ_LEN}, num_kv_pairs: 4, num_examples: 32}}]",
    f"--data.init_args.val=[{{seq_len: {SEQ_LEN}, num_kv_pairs: 4, num_examples: 32}}]",
    "--data.init_args.batch_size=16",
    "--trainer.enable_progress_bar=false",
    "--trainer.log_every_n_steps=1",  # LearningRateMonitor logs on these steps only
]
TIMEOUT = 60  # seconds for the server to start and to serve the complete logs


def command(name: str) -> str:
    """The installed console script `name` of this Python environment."""
    found = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert found, f"{name} is not installed"
    return found


@pytest.fixture(scope="module")
def log_root(tmp_path_factory) -> Path:
    """Both tiny fits, run side by side as a user would (subprocesses, offline); their log root."""
    cwd = tmp_path_factory.mktemp("tensorboard")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"HF_DATASETS_OFFLINE": "1"}
    fits = [
        subprocess.Popen(
            [command("lit_thresh"), "fit", "--config", str(QUICKSTART), *TINY,
             f"--trainer.logger.init_args.name={name}", f"--model.config.attention={attention}"],
            cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for name, attention in RUNS.items()
    ]
    try:
        for fit in fits:
            _, stderr = fit.communicate(timeout=300)
            assert fit.returncode == 0, stderr[-3000:]
    finally:
        for fit in fits:
            if fit.poll() is None:
                fit.kill()
                fit.wait()
    return cwd / "lightning_logs"


def poll(read: Callable[[], Any], done: Callable[[Any], bool], what: str) -> Any:
    """read() until done(result) or TIMEOUT seconds (the server loads the logs in the background)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        result = read()
        if done(result):
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; last answer: {str(result)[:2000]}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def server(log_root) -> Iterator[str]:
    """`tensorboard --logdir <root>` on 127.0.0.1 and a free port (picked by the server: --port 0);
    yields its base URL, and stops it after the module's tests."""
    log = log_root.parent / "tensorboard.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [command("tensorboard"), "--logdir", str(log_root), "--host", "127.0.0.1", "--port", "0"],
            stdout=stderr, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def started() -> re.Match | None:
            assert process.poll() is None, f"tensorboard exited: {log.read_text()[-3000:]}"
            return re.search(r"TensorBoard \S+ at (http://127\.0\.0\.1:\d+)/", log.read_text())

        yield poll(started, bool, "tensorboard to start").group(1)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def get(url: str, path: str, body: dict | None = None) -> bytes:
    """GET url + path, or POST the JSON body (as TensorBoard's frontend does for the hparams plugin)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def get_json(url: str, path: str, body: dict | None = None) -> Any:
    return json.loads(get(url, path, body))


def run_name(name: str) -> str:
    return f"{name}/version_0"


def diag_tags(layers: int = 2, bins: int = 4) -> set[str]:
    """The quickstart's (2 layers, 1 head, SEQ_LEN positions) per-layer/head diagnostics tags."""
    width = SEQ_LEN // bins
    names = ["zero_frac", "sink_mass", "keys_attended"]
    names += [f"keys_attended_pos{b * width:02d}-{(b + 1) * width - 1:02d}" for b in range(bins)]
    return {f"diag/layer{layer}/head0/{name}" for layer in range(layers) for name in names}


def test_runs(server):
    runs = poll(lambda: get_json(server, "/data/runs"), lambda r: len(r) >= 2, "both runs")
    assert sorted(runs) == sorted(run_name(name) for name in RUNS)


def test_scalar_tags_and_values(server):
    wanted = {"train/loss", "train/acc", "val/loss", "val/acc", "lr-AdamW/pg1"} | diag_tags()
    tags = poll(
        lambda: get_json(server, "/data/plugin/scalars/tags"),
        lambda t: all(wanted <= t.get(run_name(name), {}).keys() for name in RUNS),
        "the loss, accuracy and diagnostics tags of both runs",
    )
    beta = {"diag/layer0/head0/beta", "diag/layer1/head0/beta"}
    assert beta <= tags[run_name("threshold")].keys()  # threshold attention learns beta ...
    assert not beta & tags[run_name("softmax")].keys()  # ... softmax has none

    def last_value(name: str, tag: str) -> float:
        query = urllib.parse.urlencode({"run": run_name(name), "tag": tag})
        return get_json(server, f"/data/plugin/scalars/scalars?{query}")[-1][2]  # [wall_time, step, value]

    threshold_zeros, softmax_zeros = (last_value(name, "diag/layer0/head0/zero_frac") for name in RUNS)
    assert softmax_zeros == 0.0 < threshold_zeros <= 1.0
    assert last_value("softmax", "diag/layer1/head0/keys_attended") == (SEQ_LEN + 1) / 2  # every causal key
    assert 0.0 <= last_value("threshold", "diag/layer1/head0/keys_attended") < (SEQ_LEN + 1) / 2


def test_hparams(server):
    experiment = poll(
        lambda: get_json(server, "/data/plugin/hparams/experiment", {"experimentName": ""}),
        lambda e: "metricInfos" in e,
        "the HPARAMS experiment",
    )
    names = {h["name"] for h in experiment["hparamInfos"]}
    assert {"attention/class_path", "d_model", "n_layers", "key_conv", "optimizer/lr", "seed_everything"} <= names
    assert not {name for name in names if name.startswith("_") or "/_" in name or "init_args" in name}
    assert not {"optimizer/foreach", "optimizer/fused", "lr_scheduler/last_epoch"} & names  # internals
    assert {"val/acc", "val/loss", "train/loss"} <= {m["name"]["tag"] for m in experiment["metricInfos"]}

    statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]  # as the dashboard asks
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 10, "allowedStatuses": statuses, "colParams": []}
    groups = get_json(server, "/data/plugin/hparams/session_groups", request)["sessionGroups"]
    by_run = {group["name"]: group for group in groups}
    assert sorted(by_run) == sorted(run_name(name) for name in RUNS)
    for name, attention in RUNS.items():
        group = by_run[run_name(name)]
        assert group["hparams"]["attention/class_path"] == attention
        assert group["hparams"]["d_model"] == 64 and group["hparams"]["seed_everything"] == 1234
        metrics = {m["name"]["tag"]: m["value"] for m in group["sessions"][0]["metricValues"]}
        assert 0.0 <= metrics["val/acc"] <= 1.0 and metrics["val/loss"] > 0


def test_hparams_yaml_keeps_the_nested_hyperparameters(log_root):
    """hparams.yaml holds the model's arguments as given (nested), not the flat names of the HPARAMS tab."""
    for name in RUNS:
        (path,) = log_root.glob(f"{name}/version_*/hparams.yaml")
        hparams = yaml.safe_load(path.read_text())
        assert hparams["config"]["d_model"] == 64 and "d_model" not in hparams and "optimizer/lr" not in hparams


def test_attention_image(server):
    wanted = {"diag/layer0/attention", "diag/layer1/attention"}
    tags = poll(
        lambda: get_json(server, "/data/plugin/images/tags"),
        lambda t: all(wanted <= t.get(run_name(name), {}).keys() for name in RUNS),
        "the attention images of both runs",
    )
    assert tags[run_name("threshold")]["diag/layer1/attention"]["samples"] == 1
    query = urllib.parse.urlencode({"run": run_name("threshold"), "tag": "diag/layer1/attention"})
    images = get_json(server, f"/data/plugin/images/images?{query}")
    assert [image["step"] for image in images] == [2]  # the validation after the 2 training steps
    png = get(server, f"/data/plugin/images/individualImage?{images[-1]['query']}")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk
    assert (width, height) == (128, 128)  # one head of 32 x 32 weights, enlarged 4 times
