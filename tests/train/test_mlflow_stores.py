"""MLflow as teams run it: a real ``mlflow server`` (SQLite backend, artifact folder) on 127.0.0.1 and a
``sqlite:///`` store, each trained into through the ``yolokit`` command, resumed, and read back through the
client; and every way the tracker can fail to start is one line and exit 2 from the command line."""

from __future__ import annotations

import csv
import hashlib
import http.server
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from _processes import alive, descendants
from _torchrun_env import subprocess_env

from yolokit.accel.launcher import free_port
from yolokit.data import make_shapes
from yolokit.train.trackers.base import TrackerError
from yolokit.train.trackers.catalog import build_trackers

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):   # 16 training images, batch 8: 2 optimizer steps an epoch
    return str(make_shapes(tmp_path_factory.mktemp("shapes") / "set", n_train=16, n_val=4, imgsz=64))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` on a free port of 127.0.0.1: a SQLite backend and an artifact folder; stopped at the
    end with every process it started (asserted)."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to check that the server's processes end")
    pytest.importorskip("sqlalchemy", reason="mlflow server needs the full mlflow: pip install 'yolokit[mlflow]'")
    home = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {**subprocess_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}   # no job runner processes
    log = (home / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}", "--artifacts-destination",
                             str(home / "artifacts"), "--workers", "1"],
                            cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri, family = f"http://127.0.0.1:{port}", {proc.pid}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer in 180 s"
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        family |= descendants(proc.pid)
        yield uri, home
    finally:
        family |= descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        deadline = time.monotonic() + 15
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(family), f"mlflow server processes left: {alive(family)}"


def yolokit_train(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yolokit", "train", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def train_and_resume(shapes: str, run: Path, env: dict[str, str], cwd: Path) -> None:
    """One epoch through the command line, then ``--resume`` to two: 2 + 2 optimizer steps."""
    first = yolokit_train(["--data", shapes, "--imgsz", "64", "--epochs", "1", "--batch", "8", "--nbs", "8",
                           "--workers", "0", "--warmup-epochs", "0", "--close-mosaic", "0", "--no-plots",
                           "--tracker", "mlflow,csv", "--out", str(run)], env, cwd)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    again = yolokit_train(["--resume", str(run), "--epochs", "2"], env, cwd)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "resuming after epoch 1" in again.stdout


def close(a, b, rel=1e-4):
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-9)


def check_run(client, run: Path, experiment: str, tmp_path: Path):
    """The store holds one finished run for the run folder: its params, every step's and epoch's metrics
    (equal to steps.csv and results.csv), and its weights byte for byte."""
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == run.name
    assert client.get_experiment(got.info.experiment_id).name == experiment
    assert len(client.search_runs([got.info.experiment_id])) == 1          # the resume went on in the same run
    assert got.data.params["imgsz"] == "64" and got.data.params["batch"] == "8"
    assert got.data.params["tracker"] == str(["mlflow", "csv"]) and got.data.params["augment.mosaic"] == "1.0"
    steps = list(csv.DictReader((run / "steps.csv").open()))
    results = list(csv.DictReader((run / "results.csv").open()))
    box = client.get_metric_history(run_id, "step/box")
    assert [m.step for m in box] == [1, 2, 3, 4] and [int(r["step"]) for r in steps] == [1, 2, 3, 4]
    assert all(close(m.value, r["step/box"]) for m, r in zip(box, steps, strict=True))
    assert [m.step for m in client.get_metric_history(run_id, "step/lr")] == [1, 2, 3, 4]
    for key, name in (("mAP50-95", "mAP50-95"), ("train/cls", "train/cls"), ("data%", "data_pct")):
        history = client.get_metric_history(run_id, name)
        assert [m.step for m in history] == [2, 4]
        assert all(close(m.value, r[key]) for m, r in zip(history, results, strict=True))
    assert {a.path for a in client.list_artifacts(run_id, "weights")} == {"weights/best.pt", "weights/model.pt"}
    fetched = Path(client.download_artifacts(run_id, "weights/model.pt", str(tmp_path / "fetched")))
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (fetched, run / "weights" / "model.pt")]
    assert digest[0] == digest[1]
    return got


@pytest.mark.slow
@pytest.mark.extended   # a real `mlflow server` process (19 s); the SQL store below takes the same path
def test_a_tracking_server_receives_a_run_and_its_resume(server, shapes, tmp_path):
    uri, home = server
    env = {**subprocess_env(), "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "team"}
    run = tmp_path / "runs" / "detect"
    train_and_resume(shapes, run, env, tmp_path)
    got = check_run(mlflow.MlflowClient(uri), run, "team", tmp_path)
    assert got.info.artifact_uri.startswith("mlflow-artifacts:")            # served by the server ...
    stored = list((home / "artifacts").rglob("model.pt"))                   # ... into its artifact folder
    assert len(stored) == 1 and stored[0].read_bytes() == (run / "weights" / "model.pt").read_bytes()
    assert not (tmp_path / "runs" / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


@pytest.mark.slow
@pytest.mark.extended   # a run and its resume in subprocesses (20 s); the default run covers MLflow's logging and a
# resumed run continuing its tracker run (tests/train/test_trackers.py) and a refused SQL store (below)
def test_a_sqlite_store_receives_a_run_and_its_resume(shapes, tmp_path):
    pytest.importorskip("sqlalchemy", reason="MLflow's SQL store needs the full mlflow package")
    uri = f"sqlite:///{tmp_path / 'team.db'}"
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_TRACKING_URI"] = uri
    run = tmp_path / "runs" / "detect"
    train_and_resume(shapes, run, env, tmp_path)
    check_run(mlflow.MlflowClient(uri), run, "yolokit", tmp_path)
    assert list((tmp_path / "mlruns").rglob("model.pt"))       # MLflow's own default artifact root, ./mlruns


class Refusing(http.server.BaseHTTPRequestHandler):
    """A server that answers every request 401, as one behind a login does."""

    def do_GET(self):
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error_code": "UNAUTHENTICATED", "message": "login required"}')

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


CASES = {   # MLFLOW_TRACKING_URI (None: the default store), what the line must say
    "unreachable server": ("http://127.0.0.1:{port}", "(ConnectionError: no server answers (",
                           "start the server (mlflow server --host"),
    "login refused": ("{refusing}", "(RestException: UNAUTHENTICATED: login required)",
                      "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"),
    "bad URI": ("nowhere://store", "'nowhere://store'", "set MLFLOW_TRACKING_URI to an MLflow store: "
                                                        "sqlite:///mlflow.db"),
    "file store refused": ("file:./mlruns", "MlflowException: ", "MLflow 3 refuses file stores: use a SQL store"),
}


def assert_one_line(code: int, stderr: str, where: str, *says: str) -> None:
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"yolokit train: error: --tracker mlflow could not start a run at {where} ("), line
    assert all(s in line for s in says), line


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_tracker_that_cannot_start_is_one_line_and_exit_2(case, shapes, tmp_path, refusing, monkeypatch, capsys):
    """The command's own entry point, in this process (its imports are paid once)."""
    from yolokit.cli import main

    uri, detail, advice = CASES[case]
    uri = uri.format(port=free_port(), refusing=refusing)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")       # the 401s: no retries (they are not retried)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--data", shapes, "--imgsz", "64", "--epochs", "1", "--workers", "0", "--tracker", "mlflow",
                 "--out", str(tmp_path / "runs" / "run"), "--no-plots"])
    assert_one_line(code, capsys.readouterr().err, uri, detail, advice)
    assert not (tmp_path / "runs" / "run" / "results.csv").exists()          # nothing trained


@pytest.mark.slow
def test_mlflow_skinny_with_a_sql_store_is_one_line_and_exit_2(shapes, tmp_path):
    """The real command with mlflow-skinny (no SQLAlchemy) and the default store, a SQLite database."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("MLFLOW_")}
    code = "import sys; sys.modules['sqlalchemy'] = None; from yolokit.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "train", "--data", shapes, "--imgsz", "64", "--epochs", "1",
                           "--workers", "0", "--tracker", "mlflow", "--out", str(tmp_path / "runs" / "run")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    where = f"sqlite:///{(tmp_path / 'runs').resolve() / 'mlflow.db'}"
    assert_one_line(done.returncode, done.stderr, where,
                    "MLflow's SQL store is not in mlflow-skinny: pip install 'yolokit[mlflow]'")


def test_tensorboard_says_where_it_could_not_write(tmp_path):
    pytest.importorskip("tensorboard")
    (tmp_path / "tensorboard").write_text("a file where the folder should be")
    (tensorboard,) = build_trackers(["tensorboard"], tmp_path)
    with pytest.raises(TrackerError, match=rf"^--tracker tensorboard could not start a run at "
                                           rf"{tmp_path / 'tensorboard'} \(FileExistsError: .*\); check that this "
                                           "folder can be written$"):
        tensorboard.on_train_start(tmp_path, {})


def test_the_csv_log_says_where_it_could_not_write(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the run folder should be")
    (steps,) = build_trackers(["csv"], blocked)
    with pytest.raises(TrackerError, match=rf"^--tracker csv could not start a run at {blocked / 'steps.csv'} \("):
        steps.on_train_start(blocked, {})


def test_advice_reads_status_codes_as_words_not_digits_of_a_port(tmp_path, monkeypatch):
    """A server that does not answer at port 40389 is not a 403: the line says to start it (this advice
    named the login at random, whenever the free port picked held 401 or 403)."""
    from yolokit.train.trackers.mlflow_tracker import MLflowTracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:40389")
    tracker = MLflowTracker(tmp_path / "run")
    down = ConnectionError("no server answers (HTTPConnectionPool(host='127.0.0.1', port=40389): Max retries)")
    assert tracker.advice(down).startswith("start the server (mlflow server")
    assert tracker.advice(RuntimeError("port=40389 API request failed with error code 403 != 200")).startswith(
        "the server refused the login")
    assert tracker.advice(RuntimeError("HTTP 40389 bytes")).startswith("start the server")
