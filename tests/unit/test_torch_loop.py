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
        self.calls.append(("fetched", None if start is None else end - start))
        self.clock.in_microbatch = True

    def batch_ended(self, step, epoch):
        self.calls.append(("batch_ended", step, epoch))
        self.clock.in_microbatch = False

    def epoch_ended(self, step, epoch):
        self.calls.append(("epoch_ended", step, epoch))

    def abandon_step(self):
        self.calls.append(("abandon_step",))
        self.clock.in_microbatch = False

    def note(self, level, code, message):
        self.calls.append(("note", message[:20]))

    def __getattr__(self, name):  # forward_started, backward_ended, optimizer_started, ...
        return lambda *args: self.calls.append((name,))


class Optimizer:  # weak-referenceable, as torch.optim optimizers are
    pass


class Iterator:
    """A DataLoader iterator as the capture reads it: weak-referenceable, its loader's index
    sampler (one per DataLoader) and its batches yielded in this pass."""

    def __init__(self, sampler: object = None) -> None:
        self._index_sampler = object() if sampler is None else sampler
        self._num_yielded = 0


def fetch(target, iterator: Iterator, start: int, end: int) -> None:
    """``__next__`` returned a batch (torch counts it before the capture's door runs)."""
    iterator._num_yielded += 1
    target.fetched(iterator, start, end)


_ITERATORS: dict[int, Iterator] = {}


def loader(number: int) -> Iterator:
    """The same iterator object for the same number (a loader with persistent workers)."""
    return _ITERATORS.setdefault(number, Iterator())


@pytest.fixture
def capture(tmp_path):
    _ITERATORS.clear()
    loop = LoopCapture(Settings(logs_dir=tmp_path, run_name="t"))
    loop.session = FakeSession()
    loop.thread = threading.get_ident()
    return loop


def train_microbatch(capture, model, iterator_id=1, fetch_ns=(0, 10)):
    fetch(capture, loader(iterator_id), *fetch_ns)
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
    fetch(capture, loader(7), 0, 50)  # a validation loader's batch
    model.eval()
    with torch.no_grad():
        assert not capture.forward_started(model)
    assert capture.fetches.held is None
    model.train()
    train_microbatch(capture, model, iterator_id=1, fetch_ns=(100, 104))
    assert ("fetched", 4) in capture.session.calls and ("fetched", 54) not in capture.session.calls


def test_fetches_of_one_iterator_before_a_forward_add_up(capture):
    # The HF Trainer fetches a whole accumulation group before the first forward.
    fetch(capture, loader(1), 0, 10)
    fetch(capture, loader(1), 10, 30)
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
    capture.iterator_exhausted(loader(1))  # Accelerate's loader sees it one batch early
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
        loader(1)._num_yielded = 0  # the pass starts over (DataLoader.__iter__: _reset)
        train_microbatch(capture, model, iterator_id=1)
        step(capture, optimizer)
        capture.iterator_exhausted(loader(1))
    loader(1)._num_yielded = 0
    train_microbatch(capture, model, iterator_id=1)
    assert [c[2] for c in epochs_ended(capture)] == [0, 1, 2] and capture.epoch == 3


def test_two_zipped_loaders_both_count_as_input_wait(capture):
    # for a, b in zip(images, captions): both waits are the step's.
    fetch(capture, loader(1), 0, 10)
    fetch(capture, loader(2), 10, 90)
    assert capture.forward_started(torch.nn.Linear(2, 2))
    assert ("fetched", 90) in capture.session.calls


def test_a_teachers_evaluation_forward_keeps_the_students_input_wait(capture):
    teacher, student = torch.nn.Linear(2, 2).eval(), torch.nn.Linear(2, 2)
    fetch(capture, loader(1), 0, 40)
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
    fetch(
        capture, loader(1), 100, 110
    )  # the next training batch, then a validation before its forward
    model.eval()
    for start in (200, 300):
        fetch(capture, loader(7), start, start + 50)
        with torch.no_grad():
            assert not capture.forward_started(model)
    model.train()
    capture.iterator_exhausted(loader(7))
    assert capture.forward_started(model)
    fetches = [c for c in capture.session.calls if c[0] == "fetched"]
    assert fetches[-1][1] == 0  # not the validation batch's 50 ns (nothing waited: 0)


def test_batches_from_no_dataloader_have_input_wait_null_and_a_note(capture):
    model, optimizer = torch.nn.Linear(2, 2), Optimizer()
    for _ in range(2):
        assert capture.forward_started(model)  # tensors indexed by hand: no fetch before
        capture.forward_ended()
        step(capture, optimizer)
    assert [c for c in capture.session.calls if c[0] == "fetched"] == [("fetched", None)] * 2
    capture.finish_notes()
    assert ("note", "training batches do ") in capture.session.calls


def test_an_unmeasured_input_wait_is_null_in_the_record_and_the_rest_adds_up():
    from traceml import schema
    from traceml.capture.step_clock import StepClock

    ms = 1_000_000
    clock = StepClock(origin_ns=0)
    for start in (0, 10 * ms):  # twice: the second is a "usual" step but for its input
        clock.fetched(None, start)
        clock.forward_started(start + 1 * ms)
        clock.forward_ended(start + 3 * ms)
        clock.backward_started(start + 3 * ms)
        clock.backward_ended(start + 6 * ms)
        clock.optimizer_started(start + 6 * ms)
        record = clock.batch_ended(start + 8 * ms, global_step=1, epoch=0)
        assert schema.INPUT_WAIT not in record  # null: unmeasured, never 0
        assert record[schema.STEP] == 8.0 and record[schema.RESIDUAL] == 1.0


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


def trained(fetches, *iterators_and_spans):
    """Fetches, then a training forward takes them: what it took."""
    for iterator, start, end in iterators_and_spans:
        fetch(fetches, iterator, start, end)
    taken = fetches.for_training()
    fetches.take(taken)
    return taken


def test_a_validation_through_an_unhooked_module_is_not_the_next_steps_input():
    # After the first step only the roots are hooked: an EMA copy's validation forwards are
    # not seen, so nothing says its fetches were evaluation. Its iterator running out, or being
    # freed, drops them (review of stop 56: they opened the next step, validation in its
    # Residual).
    from traceml.capture.frameworks.torch_loop_fetches import Fetches

    fetches, train = Fetches(), Iterator()
    assert trained(fetches, (train, 0, 10)) == ((id(train),), 0, 10)
    for broken_out_of in (False, True):
        validation = Iterator()
        for start in (100, 200, 300):
            fetch(fetches, validation, start, start + 100)
        if broken_out_of:
            del validation  # the loop broke out early: the iterator is freed
        else:
            fetches.exhausted(validation)
        assert trained(fetches, (train, 1000, 1010)) == ((id(train),), 1000, 10)


def test_a_longer_zipped_loaders_last_batch_does_not_open_the_next_epoch():
    # zip(long, short): next(long) gives a batch, then short runs out; that batch fed nothing.
    from traceml.capture.frameworks.torch_loop_fetches import Fetches

    long_loader, short_loader = object(), object()  # (their index samplers)
    fetches, long, short = Fetches(), Iterator(long_loader), Iterator(short_loader)
    trained(fetches, (long, 0, 10), (short, 10, 20))
    fetch(fetches, long, 100, 130)
    fetches.exhausted(short)
    new_long, new_short = Iterator(long_loader), Iterator(short_loader)
    fetch(fetches, new_long, 50_000, 50_010)
    fetch(fetches, new_short, 50_010, 50_020)
    taken = fetches.for_training()
    assert fetches.epoch_turned(taken)
    assert taken == ((id(new_long), id(new_short)), 50_000, 20)


def test_an_iterator_with_a_freed_training_iterators_id_is_not_a_training_one():
    # CPython gives a new iterator a freed one's id: a validation iterator that ran out must
    # not end an epoch for the training iterator that had its id.
    import weakref

    from traceml.capture.frameworks.torch_loop_fetches import Fetches

    fetches, train, validation = Fetches(), Iterator(), Iterator()
    trained(fetches, (train, 0, 10))
    fetches._train = {id(validation): weakref.ref(train)}  # the id reused (forced here)
    fetch(fetches, validation, 100, 200)
    fetches.exhausted(validation)
    fetch(fetches, train, 300, 310)
    taken = fetches.for_training()
    assert not fetches.epoch_turned(taken) and taken == ((id(train),), 300, 10)


def test_a_parameter_free_module_is_not_forward_but_a_model_it_calls_is():
    """A loss module called after the model is Residual; a parameter-free wrapper that calls
    the model (``LossOf(model, x, y)``) hides nothing: the model is the outermost call."""
    from traceml.capture.frameworks.torch_loop_hooks import LoopHooks

    class LossOf(torch.nn.Module):
        def forward(self, model, x):
            return (model(x) ** 2).mean()

    capture = RootCapture()
    hooks = LoopHooks(capture)
    model, loss = UserNet(), torch.nn.MSELoss()
    hooks.install()
    try:
        loss(model(torch.ones(1, 2)), torch.zeros(1, 1))
        assert capture.calls == [("started", "UserNet"), ("ended",)]
        LossOf()(model, torch.ones(1, 2))
        assert capture.calls[2:] == [("started", "UserNet"), ("ended",)]
        assert list(hooks.roots) == [model] and hooks._depth == 0
    finally:
        hooks.remove()


def test_a_fetch_from_an_iterator_freed_at_once_is_still_the_steps_input(capture):
    # x, y = next(iter(loader)): the iterator is gone before the forward (review of stop 56:
    # the fetch was dropped as a loop broken out of, and a "not a DataLoader" note written).
    model, optimizer = torch.nn.Linear(2, 2), Optimizer()
    for start in (0, 100, 200):
        iterator = Iterator()
        fetch(capture, iterator, start, start + 5)
        del iterator
        train_microbatch_without_fetch(capture, model)
        step(capture, optimizer)
    assert [c for c in capture.session.calls if c[0] == "fetched"] == [("fetched", 5)] * 3
    capture.finish_notes()
    assert not any(c[0] == "note" for c in capture.session.calls)


def train_microbatch_without_fetch(capture, model):
    assert capture.forward_started(model)
    capture.forward_ended()
    assert capture.backward_started()
    capture.backward_ended()


def test_an_epoch_no_longer_than_the_fetches_made_ahead_is_still_an_epoch():
    # Accelerate / the HF Trainer fetch a whole accumulation group (and one batch more) before
    # the first forward: a 2-batch epoch's new iterator runs out before any forward took from
    # it. It iterates the training loader: its batches are the next epoch's, not a
    # validation loop's (review of stop 56: dropped, epochs never turned).
    from traceml.capture.frameworks.torch_loop_fetches import Fetches

    sampler, fetches = object(), Fetches()
    for epoch in range(3):
        iterator = Iterator(sampler)  # a new iterator over the same loader each epoch
        fetch(fetches, iterator, epoch * 100, epoch * 100 + 10)
        fetch(fetches, iterator, epoch * 100 + 10, epoch * 100 + 20)
        if epoch:  # (the first epoch's end comes before the session opens)
            fetches.exhausted(iterator)
        del iterator  # the loader's generator is done with it
        taken = fetches.for_training()
        assert taken is not None and taken[1:] == (epoch * 100, 20)
        assert fetches.epoch_turned(taken) is bool(epoch)
        fetches.take(taken)


def make_fetches():
    from traceml.capture.frameworks.torch_loop_fetches import Fetches

    return Fetches()


def test_persistent_workers_with_an_epoch_fetched_ahead_whole_turn_every_epoch():
    # The same iterator every epoch (reset), and the whole epoch fetched before its first
    # forward (HF Trainer, dataloader_persistent_workers=True, accumulation >= the epoch):
    # every other epoch was lost (review of stop 56).
    fetches, iterator = make_fetches(), Iterator()
    turned = []
    for epoch in range(4):
        iterator._num_yielded = 0  # DataLoader.__iter__ resets it
        fetch(fetches, iterator, epoch * 100, epoch * 100 + 10)
        fetch(fetches, iterator, epoch * 100 + 10, epoch * 100 + 20)
        if epoch:
            fetches.exhausted(iterator)
        taken = fetches.for_training()
        turned.append(fetches.epoch_turned(taken))
        fetches.take(taken)
    assert turned == [False, True, True, True]


def test_a_validation_loader_over_the_training_dataset_turns_no_epoch():
    # A SubsetRandomSampler split shares the dataset object; the loaders differ.
    fetches, train = make_fetches(), Iterator()
    trained(fetches, (train, 0, 10))
    validation = Iterator()  # its own loader (index sampler), the same dataset
    fetch(fetches, validation, 100, 200)
    fetches.exhausted(validation)  # its forwards not seen (an unwrapped model)
    taken = trained(fetches, (train, 300, 310))
    assert taken == ((id(train),), 300, 10) and not fetches.epoch_turned(taken)


def test_a_peek_before_the_loop_does_not_open_the_first_step():
    # The CIFAR tutorial: dataiter = iter(trainloader); images, labels = next(dataiter), then
    # for data in trainloader: the first step started at the peek, seconds before.
    sampler = object()
    fetches, peek, loop = make_fetches(), Iterator(sampler), Iterator(sampler)
    fetch(fetches, peek, 0, 10)
    assert trained(fetches, (loop, 5_000, 5_010)) == ((id(loop),), 5_000, 10)


def test_a_loader_made_again_inside_the_epoch_keeps_the_steps_fetch_and_turns_nothing():
    # Semi-supervised: for x_u in unlabeled: try next(l_it) except StopIteration: l_it =
    # iter(labeled). The labelled loader's new pass is not the epoch's.
    labeled_sampler = object()
    fetches, unlabeled, labeled = make_fetches(), Iterator(), Iterator(labeled_sampler)
    trained(fetches, (unlabeled, 0, 10), (labeled, 10, 20))
    fetch(fetches, unlabeled, 2_000, 2_050)
    fetches.exhausted(labeled)
    again = Iterator(labeled_sampler)
    fetch(fetches, again, 2_050, 2_060)
    taken = fetches.for_training()
    assert taken == ((id(unlabeled), id(again)), 2_000, 60)
    assert not fetches.epoch_turned(taken)


def test_an_epoch_broken_out_of_still_turns_and_its_last_batch_is_dropped():
    sampler = object()
    fetches, first = make_fetches(), Iterator(sampler)
    trained(fetches, (first, 0, 10))
    fetch(fetches, first, 100, 110)  # then `break`: this batch fed nothing
    second = Iterator(sampler)
    fetch(fetches, second, 9_000, 9_010)
    taken = fetches.for_training()
    assert taken == ((id(second),), 9_000, 10) and fetches.epoch_turned(taken)


def test_a_teacher_in_a_loop_over_next_iter_keeps_the_input_wait():
    fetches = make_fetches()
    sampler = object()
    for start in (0, 100, 200):
        iterator = Iterator(sampler)
        fetch(fetches, iterator, start, start + 7)
        del iterator  # next(iter(loader)): gone at once
        fetches.evaluated()  # the teacher's forward
        taken = trained(fetches)  # the student's, on the same batch
        assert taken is not None and taken[1:] == (start, 7)


def test_a_validation_pass_over_the_training_loader_itself_turns_no_epoch():
    # Evaluating on the training set mid-epoch with the training DataLoader object: a new pass
    # over the primary loader, taken only by evaluation forwards. The epoch turned at the next
    # training step (stop 56's note: a known limitation); the next real pass still turns it.
    sampler = object()
    fetches, train = make_fetches(), Iterator(sampler)
    trained(fetches, (train, 0, 10))
    for seen in (True, False):  # its forwards seen (evaluation) or not (an unhooked copy)
        validation = Iterator(sampler)  # iter(train_loader) again, under torch.no_grad()
        for start in (100, 200):
            fetch(fetches, validation, start, start + 50)
            if seen:
                fetches.evaluated()
        fetches.exhausted(validation)
        del validation
        fetch(fetches, train, 1_000, 1_010)
        taken = fetches.for_training()
        assert not fetches.epoch_turned(taken)
        fetches.take(taken)
    fetches.exhausted(train)
    next_epoch = Iterator(sampler)
    fetch(fetches, next_epoch, 5_000, 5_010)
    taken = fetches.for_training()
    assert fetches.epoch_turned(taken) and taken == ((id(next_epoch),), 5_000, 10)
    fetches.take(taken)
    fetch(fetches, next_epoch, 5_100, 5_110)
    assert not fetches.epoch_turned(fetches.for_training())  # said once, at the pass


def test_a_first_step_skipped_by_the_grad_scaler_still_takes_the_global_hooks_away(capture):
    # fp16 AMP's first step usually overflows: GradScaler skips optimizer.step(), so no
    # post-hook came and the global module hooks stayed on every module call of the run
    # (helper review, stop 57).
    found = []
    capture.hooks.roots_found = lambda: found.append(True)
    model, optimizer = torch.nn.Linear(2, 2), Optimizer()
    train_microbatch(capture, model)
    capture.scaler_skipped(optimizer)
    assert capture.steps == 1 and found == [True]
    train_microbatch(capture, model)
    step(capture, optimizer)
    assert capture.steps == 2 and found == [True]


def test_forwards_before_the_loop_are_no_step(capture):
    # A dry run (a train-mode forward to build lazy modules, a shape check) before the loop
    # opened the first step there: step 0 had 2 microbatches and started at the dry run.
    model, optimizer = torch.nn.Linear(2, 2), Optimizer()
    assert capture.forward_started(model)  # no fetch, no backward after it
    capture.forward_ended()
    train_microbatch(capture, model)
    step(capture, optimizer)
    calls = capture.session.calls
    assert ("abandon_step",) in calls
    assert [c for c in calls if c[0] == "batch_ended"] == [("batch_ended", 1, 0)]


def test_a_new_optimizer_for_a_second_stage_takes_over(capture):
    # Two-stage fine-tuning: a new optimizer over more parameters, the first one kept alive
    # (its lr scheduler, a variable). Its steps were all "another optimizer's": no step ended
    # in the second stage (helper review, stop 57).
    model, first, second = torch.nn.Linear(2, 2), Optimizer(), Optimizer()
    for _ in range(2):
        train_microbatch(capture, model)
        step(capture, first)
    for _ in range(3):
        train_microbatch(capture, model)
        step(capture, second)
    # The first stage-2 step is taken for another optimizer's (inside the next step).
    assert capture.steps == 4
    assert ("note", "another optimizer st") in capture.session.calls


def test_alternating_optimizers_never_take_over():
    from traceml.capture.frameworks.torch_loop_optimizers import OTHER, STEP, StepOptimizer

    judge = StepOptimizer().judge
    critic, generator = Optimizer(), Optimizer()
    verdicts = []
    for _ in range(4):  # a GAN: each step of one optimizer between two of the other's
        for optimizer in (critic, critic, generator):  # (two critic steps: still the first)
            judge(optimizer, False)
            verdicts.append(judge(optimizer, True))
    assert verdicts == [STEP, STEP, OTHER] * 4


def test_a_gan_generators_phase_is_no_microbatch_of_the_next_step(capture):
    # After the discriminator's step ended the step, the generator's forward and backward on
    # the same batch (no fetch) opened a microbatch that the next fetch closed as the next
    # step's first: every step had 2 microbatches and the generator's Forward (review).
    critic, generator = torch.nn.Linear(2, 1), torch.nn.Linear(2, 2)
    critic_opt, generator_opt = Optimizer(), Optimizer()
    for index in range(3):
        train_microbatch(capture, critic, fetch_ns=(index * 100, index * 100 + 10))
        step(capture, critic_opt)
        assert capture.forward_started(generator)  # no fetch: the same batch
        capture.forward_ended()
        assert capture.backward_started()
        capture.backward_ended()
        step(capture, generator_opt)
    calls = [c for c in capture.session.calls if c[0] in ("batch_ended", "abandon_step")]
    assert calls == [c for n in (1, 2, 3) for c in (("batch_ended", n, 0), ("abandon_step",))]


def test_an_optimizer_the_step_optimizer_calls_is_no_other_optimizers_step(capture):
    # Lookahead / ZeroRedundancyOptimizer step a hooked optimizer inside their own step; with
    # no DataLoader every microbatch began "unfed", and the inner step's post-hook abandoned
    # the open step: 1 step recorded of 20 (review of the GAN fix).
    model, outer, inner = torch.nn.Linear(2, 2), Optimizer(), Optimizer()
    for _ in range(3):
        train_microbatch_without_fetch(capture, model)
        capture.optimizer_started(outer)
        capture.optimizer_started(inner)
        capture.optimizer_ended(inner)
        capture.optimizer_ended(outer)
    assert capture.steps == 3
    assert ("abandon_step",) not in capture.session.calls


def test_a_side_optimizers_closure_step_after_training_is_another_optimizers(capture):
    # Temperature scaling with L-BFGS after 40 steps turned tracing off ("disabled") for the
    # run; mid-training, every later step was lost (review).
    model, optimizer, calibration = torch.nn.Linear(2, 2), Optimizer(), Optimizer()
    train_microbatch(capture, model)
    step(capture, optimizer)
    capture.closure_step(calibration)
    assert not capture.stood_down and ("note", "several optimizers s") in capture.session.calls
    capture.closure_step(optimizer)  # the step optimizer's own: its phases cannot be told apart
    assert capture.stood_down


def test_a_generator_stepping_twice_on_one_batch_does_not_take_over():
    from traceml.capture.frameworks.torch_loop_optimizers import OTHER, STEP, StepOptimizer

    judge = StepOptimizer().judge
    critic, generator = Optimizer(), Optimizer()
    verdicts = []
    for _ in range(3):
        verdicts.append(judge(critic, True, fed=True))
        verdicts += [judge(generator, True, fed=False) for _ in range(2)]  # the same batch
    assert verdicts == [STEP, OTHER, OTHER] * 3


def test_the_training_loaders_batch_size_and_workers_fill_what_the_loop_left_unknown():
    import torch
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from traceml import schema
    from traceml.capture.frameworks.torch_loop_facts import loop_facts, with_loader

    data = torch.utils.data.TensorDataset(torch.zeros(8, 2))

    class Buckets(BatchSampler):  # a sampler of the user's may vary its batches' size
        pass

    def facts(known, **loader):
        return with_loader(known, iter(DataLoader(data, **loader)))

    assert facts(loop_facts(), batch_size=4) == {
        schema.ACCUMULATE_GRAD_BATCHES: None,
        schema.BATCH_SIZE: 4,
        "num_workers": 0,
    }
    assert facts({}, batch_size=None).get(schema.BATCH_SIZE) is None  # each item its own batch
    buckets = Buckets(SequentialSampler(data), 4, drop_last=False)
    assert facts({}, batch_sampler=buckets).get(schema.BATCH_SIZE) is None
    known = {schema.BATCH_SIZE: 16, "num_workers": 3}  # the HF Trainer's arguments say them
    assert facts(known, batch_size=4) == known
    assert with_loader(known, None) == known  # no DataLoader fed the first step
