"""The any-loop capture's grouping of boundaries into microbatches and steps (fake session;
the real thing on real training is tests/integration/test_any_loop.py)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from traceml.capture.frameworks.torch_loop import LoopCapture  # noqa: E402
from traceml.capture.lifecycle import State  # noqa: E402
from traceml.settings import Settings  # noqa: E402


class FakeClock:
    def __init__(self, calls):
        self.calls, self.in_microbatch = calls, False


class FakeSession:
    def __init__(self):
        self.calls = []
        self.clock = FakeClock(self.calls)
        self.life = type("Life", (), {"state": State.TRACING})()

    def fetched(self, start, end):
        self.calls.append(("fetched", end - start))
        self.clock.in_microbatch = True

    def batch_ended(self, step, epoch):
        self.calls.append(("batch_ended", step, epoch))
        self.clock.in_microbatch = False

    def epoch_ended(self, step, epoch):
        self.calls.append(("epoch_ended", step, epoch))

    def note(self, level, code, message):
        self.calls.append(("note", message[:20]))

    def __getattr__(self, name):  # forward_started, backward_ended, optimizer_started, ...
        return lambda *args: self.calls.append((name,))


class Optimizer:  # weak-referenceable, as torch.optim optimizers are
    pass


@pytest.fixture
def capture(tmp_path):
    loop = LoopCapture(Settings(logs_dir=tmp_path, run_name="t"))
    loop.session = FakeSession()
    loop.thread = threading.get_ident()
    return loop


def train_microbatch(capture, model, iterator_id=1, fetch_ns=(0, 10)):
    capture.fetched(iterator_id, *fetch_ns)
    assert capture.forward_started(model)
    capture.forward_ended()
    assert capture.backward_started()
    capture.backward_ended()


def test_two_microbatches_then_the_optimizer_make_one_step(capture):
    model, optimizer = torch.nn.Linear(2, 2), Optimizer()
    train_microbatch(capture, model)
    train_microbatch(capture, model)
    capture.optimizer_started(optimizer)
    capture.optimizer_ended(optimizer)
    calls = [c for c in capture.session.calls if c[0] in ("fetched", "batch_ended")]
    # The second fetch ends the first microbatch without a step; the optimizer ends the step.
    assert calls == [("fetched", 10), ("batch_ended", 0, 0), ("fetched", 10), ("batch_ended", 1, 0)]
    assert capture.steps == 1


def test_an_evaluation_forward_drops_its_fetch_and_is_not_timed(capture):
    model = torch.nn.Linear(2, 2)
    capture.fetched(7, 0, 50)  # a validation loader's batch
    model.eval()
    with torch.no_grad():
        assert not capture.forward_started(model)
    assert capture.fetches.held is None
    model.train()
    train_microbatch(capture, model, iterator_id=1, fetch_ns=(100, 104))
    assert ("fetched", 4) in capture.session.calls and ("fetched", 54) not in capture.session.calls


def test_fetches_of_one_iterator_before_a_forward_add_up(capture):
    # The HF Trainer fetches a whole accumulation group before the first forward.
    capture.fetched(1, 0, 10)
    capture.fetched(1, 10, 30)
    assert capture.forward_started(torch.nn.Linear(2, 2))
    assert ("fetched", 30) in capture.session.calls


def step(capture, optimizer):
    capture.optimizer_started(optimizer)
    capture.optimizer_ended(optimizer)


def epochs_ended(capture):
    return [c for c in capture.session.calls if c[0] == "epoch_ended"]


def test_the_epoch_ends_at_the_first_forward_fed_by_a_fetch_after_the_loader_ran_out(capture):
    model, optimizer = torch.nn.Linear(2, 2), Optimizer()
    train_microbatch(capture, model, iterator_id=1)
    capture.iterator_exhausted(1)  # Accelerate's loader sees it one batch early
    assert capture.forward_started(model)  # the last batch, fetched before StopIteration
    capture.forward_ended()
    assert not epochs_ended(capture)
    step(capture, optimizer)
    train_microbatch(capture, model, iterator_id=2)
    assert epochs_ended(capture) == [("epoch_ended", 1, 0)] and capture.epoch == 1


def test_an_epoch_whose_iterator_has_the_last_ones_id_is_still_an_epoch(capture):
    # CPython gives the next epoch's iterator the freed one's address (its id); a loader with
    # persistent workers resets and returns the same iterator every epoch.
    model, optimizer = torch.nn.Linear(2, 2), Optimizer()
    for _epoch in range(3):
        train_microbatch(capture, model, iterator_id=1)
        step(capture, optimizer)
        capture.iterator_exhausted(1)
    train_microbatch(capture, model, iterator_id=1)
    assert [c[2] for c in epochs_ended(capture)] == [0, 1, 2] and capture.epoch == 3


def test_two_zipped_loaders_both_count_as_input_wait(capture):
    # for a, b in zip(images, captions): both waits are the step's.
    capture.fetched(1, 0, 10)
    capture.fetched(2, 10, 90)
    assert capture.forward_started(torch.nn.Linear(2, 2))
    assert ("fetched", 90) in capture.session.calls


def test_a_teachers_evaluation_forward_keeps_the_students_input_wait(capture):
    teacher, student = torch.nn.Linear(2, 2).eval(), torch.nn.Linear(2, 2)
    capture.fetched(1, 0, 40)
    with torch.no_grad():
        assert not capture.forward_started(teacher)
    assert capture.forward_started(student)  # the same batch, no fetch between
    capture.forward_ended()
    assert capture.backward_started()
    capture.backward_ended()
    step(capture, Optimizer())
    assert ("fetched", 40) in capture.session.calls
    capture.finish_notes()
    assert not any(c[0] == "note" for c in capture.session.calls)  # no "not a DataLoader"


def test_a_validation_loops_last_batch_is_not_the_next_steps_input(capture):
    model, optimizer = torch.nn.Linear(2, 2), Optimizer()
    train_microbatch(capture, model, iterator_id=1)
    step(capture, optimizer)
    capture.fetched(1, 100, 110)  # the next training batch, then a validation before its forward
    model.eval()
    for start in (200, 300):
        capture.fetched(7, start, start + 50)
        with torch.no_grad():
            assert not capture.forward_started(model)
    model.train()
    capture.iterator_exhausted(7)
    assert capture.forward_started(model)
    fetches = [c for c in capture.session.calls if c[0] == "fetched"]
    assert fetches[-1][1] < 50  # not the validation batch's 50 ns (now, now: unmeasured)


def test_microbatches_left_at_an_epochs_end_end_with_their_last_phase():
    """The any-loop learns that an epoch ended at the next epoch's first forward, after the
    validation: the microbatches left without a step end where their backward did, and the open
    one counts."""
    from traceml.capture.step_clock import StepClock

    ms = 1_000_000
    clock = StepClock(origin_ns=0)
    clock.fetched(0, 1 * ms)
    clock.forward_started(1 * ms)
    clock.forward_ended(2 * ms)
    clock.backward_started(2 * ms)
    clock.backward_ended(4 * ms)
    closed = clock.epoch_closed(500 * ms)  # the validation ran from 4 ms to 500 ms
    record = closed.record()
    assert closed.end_ns == 4 * ms and closed.microbatches == 1
    assert record["step_ms"] == pytest.approx(4.0)


def test_a_second_optimizer_does_not_end_steps(capture):
    model, first, second = torch.nn.Linear(2, 2), Optimizer(), Optimizer()
    train_microbatch(capture, model)
    capture.optimizer_started(first)
    capture.optimizer_ended(first)
    train_microbatch(capture, model)
    capture.optimizer_started(second)
    capture.optimizer_ended(second)
    assert capture.steps == 1
    assert ("note", "several optimizers s") in capture.session.calls


def test_the_trainer_callbacks_time_is_counted_as_the_captures(capture):
    """``traceml_us`` sums the session's cost owners, the capture among them: the Hugging Face
    callback's events (guarded entry points) add their time to the capture's count."""
    from traceml.capture.frameworks.hf_trainer import StepEvents

    events = StepEvents(capture)
    before = capture.own_cost_ns
    events.on_pre_optimizer_step(None, None, None)
    assert ("optimizer_started",) in capture.session.calls
    assert capture.own_cost_ns > before
    assert "own_cost_ns" not in vars(events)


class RootCapture:
    """What LoopHooks calls around a root's forward."""

    def __init__(self):
        self.calls = []

    def forward_started(self, module):
        self.calls.append(("started", type(module).__name__))
        return True

    def forward_ended(self):
        self.calls.append(("ended",))


class UserNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.linear(x)


class CopyingNet(UserNet):
    """A user model that copies itself (its own __deepcopy__, as EMA recipes do), which
    copies the instance's __dict__ as it is: the module's hook dicts with it."""

    def forward(self, x):
        return self.linear(x) * 2

    def __deepcopy__(self, memo):
        import copy

        twin = type(self).__new__(type(self))
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return twin


@pytest.mark.parametrize(
    "make", [UserNet, CopyingNet, lambda: torch.nn.Sequential(torch.nn.Linear(2, 1))]
)
def test_a_loops_root_is_timed_and_freed_while_its_undo_waits_for_the_exit(make):
    """After the first optimizer step the loop times its roots only: a door on the root's own
    class (model.forward a bound method, no hooks: torch.jit.script works as untraced), else
    hooks (a torch class). Either way the undo, kept until the interpreter's exit, holds the
    root weakly: a script that drops its model frees it (its parameters' memory)."""
    import gc
    import inspect
    import weakref

    from traceml.capture.frameworks.torch_loop_hooks import LoopHooks

    capture = RootCapture()
    hooks = LoopHooks(capture)
    model = make()
    hooks.install()  # torch's global module hooks find the root at its first call
    try:
        model(torch.ones(1, 2))
        assert list(hooks.roots) == [model]
        hooks.roots_found()  # the first optimizer step's
        capture.calls.clear()
        model(torch.ones(1, 2))
        assert capture.calls == [("started", type(model).__name__), ("ended",)]
        on_class = isinstance(model, UserNet)  # (CopyingNet too: its own forward)
        assert (not model._forward_hooks) is on_class
        assert inspect.ismethod(model.forward) and "forward" not in vars(model)
        if on_class:
            torch.jit.script(model)
        import copy

        twin = copy.deepcopy(model)  # no traceml object in the copy: it copies as untraced
        twin(torch.ones(1, 2))
        assert len(capture.calls) == 2  # the copy's forward is not the traced root's
        held = weakref.ref(model)
        del model
        gc.collect()
        assert held() is None
    finally:
        hooks.remove()
    assert "traceml" not in UserNet.forward.__code__.co_filename


def test_a_training_after_the_first_trainer_was_freed_is_still_the_second(capsys):
    """One traced training per process: the claim held its owner weakly, so once a script
    dropped its first trainer (freed since the exit handler lets go of finished sessions) a
    second training could claim the process and write into the same run."""
    import gc

    from traceml import console
    from traceml.capture import claim

    class Trainer:
        pass

    claim.reset_for_tests()
    console.reset_for_tests()
    try:
        first = Trainer()
        assert claim.claim(first)
        assert claim.claim(first)  # the same training again (a Tuner's fit, then yours)
        del first
        gc.collect()
        assert not claim.claim(Trainer())
        assert "a second training in this process is not traced" in capsys.readouterr().err
    finally:
        claim.reset_for_tests()
        console.reset_for_tests()
