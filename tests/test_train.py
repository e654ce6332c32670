"""Training stages on tiny models: what trains, that it learns, resume and data parallelism."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import MIXERS, open_gates, spec_for, tiny_model

from recurformer.config import ConfigError
from recurformer.mixers import MixerConfig
from recurformer.surgery import convert
from recurformer.train import LMObjective, TrainConfig, TrainingDiverged, TransferObjective, train

SEQ = 32


def setup(init="random", beta=0.5, arch="llama", mixer=None):
    teacher = tiny_model(arch)
    student = convert(teacher, spec_for(teacher, beta), mixer, init=init)
    sequences = torch.randint(0, 97, (16, SEQ), generator=torch.Generator().manual_seed(0))
    return teacher, student, sequences


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mixer, steps", [("mamba", 120), ("mamba2", 40), ("window", 40)])
def test_transfer_mse_falls_tenfold_on_a_fixed_batch(tmp_path, mixer, steps):
    teacher, student, sequences = setup(mixer=MIXERS[mixer])
    config = TrainConfig(stage="transfer", steps=steps, seq_len=SEQ, batch_size=4, lr=1e-2, warmup=0.0)
    train(student, TransferObjective(teacher, student), sequences[:4], config, tmp_path, progress=False)
    losses = [r["loss"] for r in log(tmp_path)]
    assert losses[-1] * 10 <= losses[0], (losses[0], losses[-1])


def test_transfer_target_is_exactly_a_reused_window_covering_the_sequence(tmp_path):
    """With reused weights and a window covering the sequence, the window mixer is the
    replaced heads: the transfer loss is zero only if it gets the teacher's positions."""
    teacher, student, sequences = setup(init="reuse", arch="qwen2", mixer=MixerConfig(kind="window", window=SEQ, sinks=0))
    objective = TransferObjective(teacher, student)
    loss, metrics = objective.loss(objective.prepare(student), sequences[:2])
    assert metrics["relative_mse"] < 1e-10


def changed_parameters(model, before):
    return {n for n, p in model.state_dict().items() if not torch.equal(p, before[n])}


@pytest.mark.parametrize("stage, trainable", [("transfer", "mixers"), ("lm", "mixers"), ("lm", "mixers+lora"), ("lm", "all")])
def test_only_the_intended_parameters_change(tmp_path, stage, trainable):
    teacher, student, sequences = setup()
    before = {n: p.clone() for n, p in student.state_dict().items()}
    teacher_before = {n: p.clone() for n, p in teacher.state_dict().items()}
    config = TrainConfig(stage=stage, steps=2, seq_len=SEQ, batch_size=4, lr=1e-2, trainable=trainable, warmup=0.0)
    objective = TransferObjective(teacher, student) if stage == "transfer" else LMObjective(trainable)
    train(student, objective, sequences, config, tmp_path, progress=False)
    changed = changed_parameters(student, before)
    assert set(student.state_dict()) == set(before)  # LoRA merged away, nothing added
    mixers = {n for n in before if ".mixer." in n}
    projections = {n for n in before if n.rsplit(".", 2)[-2] in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}
    if trainable == "mixers":
        assert changed == mixers
    elif trainable == "mixers+lora":
        assert mixers <= changed and changed <= mixers | projections
        assert changed & projections
    else:
        assert len(changed) >= 0.9 * len(before)
    assert not changed_parameters(teacher, teacher_before)


class Interrupt(Exception):
    pass


class StopsAt:
    """Wraps an objective and raises after `calls` losses (a crash mid-run)."""

    def __init__(self, objective, calls):
        self.objective, self.calls = objective, calls

    def prepare(self, model):
        return self.objective.prepare(model)

    def loss(self, module, ids):
        self.calls -= 1
        if self.calls < 0:
            raise Interrupt()
        return self.objective.loss(module, ids)

    def finish(self, module):
        return self.objective.finish(module)


@pytest.mark.parametrize("trainable", ["mixers", "mixers+lora"])
def test_resumed_run_is_bit_identical(tmp_path, trainable):
    config = TrainConfig(stage="lm", steps=6, seq_len=SEQ, batch_size=4, grad_accum=2, lr=5e-3, trainable=trainable,
                         checkpoint_every=2, warmup=0.2)
    _, straight, sequences = setup()
    train(straight, LMObjective(trainable), sequences, config, tmp_path / "a", progress=False)

    _, interrupted, _ = setup()
    with pytest.raises(Interrupt):  # dies during step 5, after the checkpoint of step 4
        train(interrupted, StopsAt(LMObjective(trainable), 9), sequences, config, tmp_path / "b", progress=False)
    assert json.loads((tmp_path / "b/checkpoint/trainer_state.json").read_text())["step"] == 4
    _, resumed, _ = setup()
    train(resumed, LMObjective(trainable), sequences, config, tmp_path / "b", resume=True, progress=False)

    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert [r["loss"] for r in log(tmp_path / "a")] == [r["loss"] for r in log(tmp_path / "b")]


def test_resume_refuses_other_settings(tmp_path):
    _, student, sequences = setup()
    config = TrainConfig(stage="lm", steps=2, seq_len=SEQ, batch_size=4, checkpoint_every=1)
    train(student, LMObjective(), sequences, config, tmp_path, progress=False)
    other = TrainConfig(stage="lm", steps=2, seq_len=SEQ, batch_size=4, checkpoint_every=1, lr=0.5)
    with pytest.raises(ConfigError, match=r"other settings \(lr\)"):
        train(student, LMObjective(), sequences, other, tmp_path, resume=True, progress=False)


class Explodes:
    def __init__(self, objective, at_call):
        self.objective, self.at_call = objective, at_call

    def prepare(self, model):
        return self.objective.prepare(model)

    def loss(self, module, ids):
        self.at_call -= 1
        loss, metrics = self.objective.loss(module, ids)
        return (loss * float("nan"), metrics) if self.at_call < 0 else (loss, metrics)

    def finish(self, module):
        pass


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    _, student, sequences = setup()
    config = TrainConfig(stage="lm", steps=6, seq_len=SEQ, batch_size=4, checkpoint_every=2)
    with pytest.raises(TrainingDiverged, match="loss became nan at step 3"):
        train(student, Explodes(LMObjective(), 3), sequences, config, tmp_path, progress=False)
    state = json.loads((tmp_path / "checkpoint/trainer_state.json").read_text())
    assert state["step"] == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(steps=None), "exactly one of --steps and --tokens"),
        (dict(lr=-1.0), "--lr must be a positive number"),
        (dict(trainable="everything", stage="lm"), "--trainable: unknown 'everything'"),
        (dict(trainable="all"), "the transfer stage trains the mixers"),
        (dict(stage="finetune"), "--stage: unknown 'finetune'"),
    ],
)
def test_bad_settings_name_the_flag(kwargs, message):
    base = dict(stage="transfer", steps=1)
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{**base, **kwargs})


def test_labels_restrict_the_lm_loss_to_the_labeled_tokens(tmp_path):
    _, student, sequences = setup()
    with torch.no_grad():
        logits = student(sequences, use_cache=False).logits
    # Label the last three positions with the model's own guesses: their loss is far below
    # the loss over all tokens, so a loop that ignored the labels would be noticed.
    labels = torch.full_like(sequences, -100)
    labels[:, -3:] = logits[:, -4:-1].argmax(-1)
    answers_only = torch.nn.functional.cross_entropy(logits[:, -4:-1].flatten(0, 1), labels[:, -3:].flatten()).item()
    every_token = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), sequences[:, 1:].flatten()).item()
    assert every_token - answers_only > 1.0
    config = TrainConfig(stage="lm", steps=1, seq_len=SEQ, batch_size=len(sequences), trainable="all")
    train(student, LMObjective("all"), sequences, config, tmp_path, progress=False, labels=labels)
    assert log(tmp_path)[0]["loss"] == pytest.approx(answers_only, rel=1e-3)  # fp32 kernels differ slightly


def test_weights_weigh_each_position_in_the_lm_loss(tmp_path):
    """The logged loss of a step is the weighted mean of the per-position losses; a loop that
    ignored the weights would log the plain mean, far from it (the heavy positions are each
    row's eight lowest losses)."""
    _, student, sequences = setup()
    with torch.no_grad():
        logits = student(sequences, use_cache=False).logits
    per_position = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), sequences[:, 1:].flatten(),
                                                     reduction="none").view(len(sequences), -1)
    weights = torch.ones(sequences.shape)
    weights.scatter_(1, per_position.topk(8, dim=1, largest=False).indices, 50.0)
    expected = (per_position * weights[:, :-1]).sum() / weights[:, :-1].sum()
    assert per_position.mean().item() - expected.item() > 0.3
    config = TrainConfig(stage="lm", steps=1, seq_len=SEQ, batch_size=len(sequences), trainable="all")
    train(student, LMObjective("all"), sequences, config, tmp_path, progress=False, weights=weights)
    assert log(tmp_path)[0]["loss"] == pytest.approx(expected.item(), rel=1e-3)


@pytest.mark.parametrize("stage, weights, message", [
    ("lm", lambda s: torch.ones(s.shape[0], s.shape[1] - 1), r"weights \(16, 31\) do not match sequences \(16, 32\)"),
    ("transfer", lambda s: torch.ones(s.shape), "position weights apply to the lm stage's loss only"),
])
def test_weights_must_match_the_sequences_and_the_stage(tmp_path, stage, weights, message):
    _, student, sequences = setup()
    config = TrainConfig(stage=stage, steps=1, seq_len=SEQ, batch_size=4)
    with pytest.raises(ConfigError, match=message):
        train(student, LMObjective(), sequences, config, tmp_path, progress=False, weights=weights(sequences))


def test_one_process_can_train_in_two_precisions(tmp_path):
    for i, precision in enumerate(("no", "bf16", "no")):
        _, student, sequences = setup()
        config = TrainConfig(stage="lm", steps=1, seq_len=SEQ, batch_size=4, trainable="mixers", precision=precision)
        summary = train(student, LMObjective("mixers"), sequences[:4], config, tmp_path / f"{i}-{precision}", progress=False)
        assert summary["steps"] == 1 and summary["precision"] == precision


def test_the_summary_records_what_auto_precision_resolved_to(tmp_path, monkeypatch):
    for amx, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr("recurformer.train.loop._cpu_has_amx", lambda amx=amx: amx)
        _, student, sequences = setup()
        config = TrainConfig(stage="lm", steps=1, seq_len=SEQ, batch_size=4, trainable="mixers", precision="auto",
                             device="cpu")
        train(student, LMObjective("mixers"), sequences[:4], config, tmp_path / expected, progress=False)
        assert json.loads((tmp_path / expected / "train_summary.json").read_text())["precision"] == expected


def test_labels_must_match_the_sequences(tmp_path):
    _, student, sequences = setup()
    config = TrainConfig(stage="lm", steps=1, seq_len=SEQ, batch_size=4)
    with pytest.raises(ConfigError, match=r"labels \(16, 31\) do not match sequences \(16, 32\)"):
        train(student, LMObjective(), sequences, config, tmp_path, progress=False, labels=sequences[:, 1:])


def test_tokens_budget_sets_the_steps():
    assert TrainConfig(stage="lm", tokens=10_000, batch_size=4, seq_len=512).total_steps == 5


DDP_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from tiny_models import MIXERS, open_gates, spec_for, tiny_model
from recurformer.surgery import convert
from recurformer.train import LMObjective, TrainConfig, train
teacher = tiny_model("llama")
student = convert(teacher, spec_for(teacher, 0.5), init="random")
sequences = torch.randint(0, 97, (16, {seq}), generator=torch.Generator().manual_seed(0))
config = TrainConfig(stage="lm", steps=4, seq_len={seq}, batch_size=4, lr=5e-3, grad_accum={accum})
train(student, LMObjective(), sequences, config, {out!r}, progress=False)
"""


def run_script(tmp_path, name, processes, accum):
    out = tmp_path / name
    script = tmp_path / f"{name}.py"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parent), seq=SEQ, accum=accum, out=str(out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if processes == 1:
        command = [sys.executable, str(script)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return [r["loss"] for r in log(out)]


def test_two_processes_follow_the_same_loss_curve_as_one(tmp_path):
    one = run_script(tmp_path, "one", processes=1, accum=2)
    two = run_script(tmp_path, "two", processes=2, accum=1)
    assert len(one) == len(two) == 4
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-5, (one, two)


def reference_losses(hidden, weight, targets, teacher_hidden, teacher_weight, ce_weight, kl_weight, t):
    """The plain, unchunked losses over full `[N, V]` logits."""
    logits = hidden @ weight.T
    ce = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
    kl = torch.nn.functional.kl_div(
        (logits / t).log_softmax(-1), (teacher_hidden @ teacher_weight.T / t).log_softmax(-1),
        log_target=True, reduction="batchmean",
    ) * t * t
    return ce_weight * ce + kl_weight * kl, ce, kl


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("ce_weight, kl_weight, t", [(1.0, 0.0, 1.0), (0.0, 1.0, 2.0), (0.5, 2.0, 1.5)])
def test_chunked_head_losses_equal_the_plain_ones_and_their_gradients(chunk, ce_weight, kl_weight, t):
    from recurformer.train.lm import head_losses

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(23, 16, generator=g), torch.randn(50, 16, generator=g)
    targets = torch.randint(0, 50, (23,), generator=g)
    targets[[0, 5, 22]] = -100
    upstream = 0.7  # the loss is scaled after head_losses (e.g. by gradient accumulation)
    loss, ce, kl = head_losses(hidden, weight, targets, teacher_hidden, teacher_weight, ce_weight, kl_weight, t, chunk=chunk)
    (upstream * loss).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected, ce_ref, kl_ref = reference_losses(hidden, weight, targets, teacher_hidden, teacher_weight, ce_weight, kl_weight, t)
    (upstream * expected).backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close((ce, kl), (ce_ref.detach(), kl_ref.detach() if kl_weight else torch.tensor(0.0)))
    torch.testing.assert_close(got, (hidden.grad, weight.grad))


@pytest.mark.parametrize("ce_weight, kl_weight, t", [(1.0, 0.0, 1.0), (0.0, 1.0, 2.0), (0.5, 2.0, 1.5)])
def test_row_weights_make_weighted_means_and_all_ones_the_plain_ones(ce_weight, kl_weight, t):
    from recurformer.train.lm import head_losses

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g)
    teacher_hidden, teacher_weight = torch.randn(23, 16, generator=g), torch.randn(50, 16, generator=g)
    targets = torch.randint(0, 50, (23,), generator=g)
    targets[[0, 5, 22]] = -100
    row_weights = torch.rand(23, generator=g) * 10 + 0.1
    args = (hidden, weight, targets, teacher_hidden, teacher_weight, ce_weight, kl_weight, t)
    loss, ce, kl = head_losses(*args, chunk=7, row_weights=row_weights)
    loss.backward()
    got, hidden.grad = hidden.grad.clone(), None
    logits = hidden @ weight.T
    scored = targets >= 0
    ce_rows = torch.nn.functional.cross_entropy(logits[scored], targets[scored], reduction="none")
    ce_ref = (ce_rows * row_weights[scored]).sum() / row_weights[scored].sum()
    kl_rows = torch.nn.functional.kl_div((logits / t).log_softmax(-1), (teacher_hidden @ teacher_weight.T / t).log_softmax(-1),
                                         log_target=True, reduction="none").sum(-1)
    kl_ref = (kl_rows * row_weights).sum() / row_weights.sum() * t * t
    (ce_weight * ce_ref + kl_weight * kl_ref).backward()
    torch.testing.assert_close((ce, kl), (ce_ref.detach(), kl_ref.detach() if kl_weight else torch.tensor(0.0)))
    torch.testing.assert_close(got, hidden.grad)
    hidden.grad = None
    ones = head_losses(*args, chunk=7, row_weights=torch.ones(23))
    plain = head_losses(*args, chunk=7)
    torch.testing.assert_close(ones, plain)


def test_kl_only_objective_matches_the_teachers_logits(tmp_path):
    teacher, student, sequences = setup(mixer=MIXERS["window"], init="reuse")
    objective = LMObjective("mixers", teacher, distill_weight=1.0, ce_weight=0.0)
    module = objective.prepare(student)
    ids = sequences[:2]
    loss, metrics = objective.loss(module, ids)
    with torch.no_grad():
        s, t = student(ids, use_cache=False).logits, teacher(ids).logits
    expected = torch.nn.functional.kl_div(s.log_softmax(-1).flatten(0, 1), t.log_softmax(-1).flatten(0, 1),
                                          log_target=True, reduction="batchmean")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4) and metrics["kl"] == pytest.approx(loss.item())
    assert metrics["ce"] > 1.0  # logged though not trained


def lm_loss_and_gradients(teacher, student, ids, recompute: bool, **objective) -> tuple[float, dict[str, torch.Tensor]]:
    objective = LMObjective(teacher=teacher, recompute=recompute, **objective)
    module = objective.prepare(student)
    loss, _ = objective.loss(module, ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}
    objective.finish(module)
    return loss.item(), grads


@pytest.mark.parametrize("trainable, kind, kl", [("tail", "window+mamba2", 1.0), ("mixers", "mamba2", 0.0),
                                                 ("all", "window", 0.5)])
def test_recomputed_layers_give_the_same_loss_and_gradients(trainable, kind, kl):
    """The lm stage recomputes the student's decoder layers in the backward pass to save memory;
    its loss and gradients are those of the plain backward pass."""
    teacher, student, sequences = setup(mixer=MIXERS[kind], init="reuse")
    open_gates(student)
    ids = sequences[:3]
    settings = dict(trainable=trainable, distill_weight=kl, ce_weight=1.0 - kl / 2)
    plain = lm_loss_and_gradients(teacher, copy.deepcopy(student), ids, recompute=False, **settings)
    recomputed = lm_loss_and_gradients(teacher, student, ids, recompute=True, **settings)
    assert recomputed[0] == pytest.approx(plain[0], rel=1e-6)
    assert recomputed[1].keys() == plain[1].keys() and plain[1]
    torch.testing.assert_close(recomputed[1], plain[1], rtol=1e-5, atol=1e-7)
    assert all("forward" not in vars(layer) for layer in student.model.layers)  # finish undid it


@pytest.mark.parametrize("stage", ["transfer", "lm"])
def test_tail_trains_only_the_recurrent_branches_and_gates(tmp_path, stage):
    teacher, student, sequences = setup(init="reuse", mixer=MIXERS["window+mamba2"])
    before = {n: p.clone() for n, p in student.state_dict().items()}
    config = TrainConfig(stage=stage, steps=2, seq_len=SEQ, batch_size=4, lr=1e-2, trainable="tail", warmup=0.0,
                         distill_weight=1.0, ce_weight=0.0)
    objective = TransferObjective(teacher, student, "tail") if stage == "transfer" else LMObjective("tail", teacher, 1.0, ce_weight=0.0)
    train(student, objective, sequences, config, tmp_path, progress=False)
    changed = changed_parameters(student, before)
    tail = {n for n in before if ".mixer.recurrent." in n or n.endswith(".mixer.gate")}
    assert changed == tail


def test_tail_and_kept_queries_train_only_those(tmp_path):
    """`tail+q` (issue 44): the tails and gates and the kept heads' query projections change;
    the window's projections, the kept keys and values and everything else do not."""
    teacher, student, sequences = setup(init="reuse", mixer=MIXERS["window+mamba2"])
    before = {n: p.clone() for n, p in student.state_dict().items()}
    config = TrainConfig(stage="lm", steps=2, seq_len=SEQ, batch_size=4, lr=1e-2, trainable="tail+q", warmup=0.0,
                         distill_weight=1.0, ce_weight=0.0)
    train(student, LMObjective("tail+q", teacher, 1.0, ce_weight=0.0), sequences, config, tmp_path, progress=False)
    changed = changed_parameters(student, before)
    tail = {n for n in before if ".mixer.recurrent." in n or n.endswith(".mixer.gate")}
    queries = {n for n in before if ".self_attn.q_proj." in n}
    assert tail and queries and changed == tail | queries


@pytest.mark.parametrize("stage", ["transfer", "lm"])
def test_tail_needs_window_recurrent_mixers(tmp_path, stage):
    teacher, student, sequences = setup(mixer=MIXERS["mamba2"])
    objective = TransferObjective(teacher, student, "tail") if stage == "transfer" else LMObjective("tail")
    with pytest.raises(ConfigError, match=r"--trainable tail needs mixers with a tail \((.*)\); this model has none") as error:
        objective.prepare(student)
    named = error.value.args[0].split("(")[1].split(")")[0].split(", ")  # every registered kind with a tail
    assert {"window+linear", "window+mamba", "window+mamba2"} <= set(named) and "mamba2" not in named


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(ce_weight=-1.0), "--ce-weight must be >= 0"), (dict(ce_weight=0.0), "--ce-weight 0 needs --distill-weight > 0")],
)
def test_bad_loss_weights_name_the_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(stage="lm", steps=1, **kwargs)
