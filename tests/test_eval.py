"""`distrain eval`: lm-evaluation-harness on a run's checkpoints through `DistrainLM`, with a
local multiple-choice task written here in the harness's own format (a task YAML over a JSONL
file; the hub is never asked).

The task: 24 random four-letter keys, each with its four-letter value; a question is `KEY=`
with four values to choose from (the right one at a random place), 96 questions, chance 1/4.
A tiny model trained on `KEY=VALUE;` lines scores far above chance; the same run's checkpoint
after its first step scores at chance, and so does the trained model behind a wrapper that
ignores the continuation (its choices all score alike, so the harness takes the first)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import cli_in_process, train_in_process

from distrain.observe.metrics import read_metrics
from distrain.observe.trackers import read_ids

lm_eval = pytest.importorskip("lm_eval")

TASK = "kv_choice"
PAIRS = 24
QUESTIONS_PER_KEY = 4
# 40 steps already score 0.99 (60 and more: 1.0); 60 leave a margin above TRAINED_BOUND.
STEPS = 60
CHANCE_BOUND = 0.45  # P(acc >= 0.45) at chance (binomial 96, 1/4) is about 1e-5
TRAINED_BOUND = 0.8


def _words(rng: random.Random, n: int) -> list[str]:
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4)))
    return sorted(words)


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> tuple[Path, Path]:
    """(training corpus, task folder for --include-path)."""
    root = tmp_path_factory.mktemp("task")
    rng = random.Random(0)
    keys, values = _words(rng, PAIRS), _words(rng, 2 * PAIRS)[:PAIRS]
    answer = dict(zip(keys, rng.sample(values, PAIRS), strict=True))
    lines = [f"{k}={answer[k]};\n" for k in keys for _ in range(150)]
    rng.shuffle(lines)
    corpus = root / "corpus.txt"
    corpus.write_text("".join(lines))
    docs = []
    for key in keys:
        for _ in range(QUESTIONS_PER_KEY):
            choices = rng.sample([v for v in values if v != answer[key]], 3)
            gold = rng.randrange(4)
            choices.insert(gold, answer[key])
            docs.append({"key": key, "choices": choices, "gold": gold})
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "kv_choice.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "kv_choice.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{key}}="\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )
    return corpus, tasks


@pytest.fixture(scope="module")
def trained_run(task, tmp_path_factory) -> Path:
    """A run with a checkpoint after step 1 and one after step STEPS."""
    corpus, _ = task
    root = tmp_path_factory.mktemp("eval")
    run = root / "run"
    fields = {
        # A local MLflow store (the tracking server itself is tests/test_tracking.py's).
        "metrics__mlflow__tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
        "data__path": str(corpus),
        "training__global_batch_size": 16,
        "training__micro_batch_size": 16,
        "training__seq_len": 64,
        "training__log_interval_steps": 50,
        "optim__lr": 3e-3,
        "optim__warmup_steps": 10,
        "checkpoint__interval_steps": 0,
    }
    # A local store keeps artifacts in the working directory's ./mlruns (MLflow's default
    # artifact root, fixed in the experiment when it is created): here, in the test's folder.
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        train_in_process(run, training__steps=1, **fields)
        train_in_process(run, training__steps=STEPS, **fields)  # resumes after step 1
    return run


def test_eval_scores_the_trained_checkpoint_above_chance(trained_run, task, capsys):
    _, tasks = task
    result = cli_in_process(
        capsys, "eval", str(trained_run), "--tasks", TASK, "--include-path", str(tasks)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    path = trained_run / "eval" / f"step-{STEPS:08d}.json"
    assert result.stdout.splitlines()[-1] == str(path)
    saved = json.loads(path.read_text())
    acc = saved["results"][TASK]["acc,none"]
    assert saved["step"] == STEPS and saved["n-samples"][TASK]["effective"] == 96
    assert acc >= TRAINED_BOUND, acc
    rows = [r for r in read_metrics(trained_run / "metrics.jsonl") if f"eval/{TASK}/acc" in r]
    assert rows[-1] == {"step": STEPS, f"eval/{TASK}/acc": acc, "attempt": 1}
    # The training run's MLflow run (trackers.json) got the result and the results file.
    client = pytest.importorskip("mlflow").MlflowClient(
        f"sqlite:///{trained_run.parent / 'mlflow.db'}"
    )
    run_id = read_ids(trained_run)["mlflow"]
    history = client.get_metric_history(run_id, f"eval/{TASK}/acc")
    assert [(m.step, m.value) for m in history] == [(STEPS, acc)]
    assert [a.path for a in client.list_artifacts(run_id, "eval")] == [f"eval/{path.name}"]
    assert client.get_run(run_id).info.status == "FINISHED"  # as training left it


def test_eval_of_the_first_step_and_of_a_broken_wrapper_are_at_chance(trained_run, task):
    from distrain.data.tokenizer import ByteTokenizer
    from distrain.evaluate.downstream import run_eval
    from distrain.evaluate.harness import DistrainLM
    from distrain.interop.export import load_run_model

    _, tasks = task
    path, row = run_eval(trained_run, tasks=[TASK], step=1, include_path=tasks)
    assert path.name == "step-00000001.json"
    assert row[f"eval/{TASK}/acc"] <= CHANCE_BOUND, row

    class IgnoresContinuation(DistrainLM):
        def _split(self, context: str, continuation: str):
            head, _ = super()._split(context, continuation)
            return head, []

    model, _ = load_run_model(trained_run)
    manager = lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=IgnoresContinuation(model, ByteTokenizer(), max_length=model.args.max_seq_len),
        tasks=[TASK],
        task_manager=manager,
        bootstrap_iters=0,
        log_samples=False,
    )
    assert out["results"][TASK]["acc,none"] <= CHANCE_BOUND


def test_eval_refuses_what_it_cannot_run(trained_run, task, capsys):
    _, tasks = task
    cases = [
        (
            ["--tasks", "nosuch", "--include-path", str(tasks)],
            f"--tasks: no task 'nosuch' in {tasks}",
        ),
        (["--tasks", TASK, "--limit", "0"], "--limit must be >= 1 (examples per task), got 0"),
        (["--tasks", TASK, "--step", "7", "--include-path", str(tasks)], "no at step 7 checkpoint"),
    ]
    for args, expected in cases:
        result = cli_in_process(capsys, "eval", str(trained_run), *args)
        assert result.returncode == 1 and expected in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
