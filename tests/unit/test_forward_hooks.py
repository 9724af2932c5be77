"""traceml's forward hooks and forward wrappers time the forward and are invisible to pickle,
deepcopy and torch.save (traceml.capture.forward_hooks; on real training: test_transparency.py,
test_any_loop.py)."""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import io
import pickle
import threading
import typing
import weakref

import pytest

torch = pytest.importorskip("torch")

from traceml.capture.forward_hooks import (  # noqa: E402
    add_forward_hooks,
    call_before_method,
    can_wrap_forward,
    wrap_forward,
    wrap_forward_once,
)


class Timer:
    """Stands for traceml's side: a bound method of an object that must never be pickled."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lock = threading.Lock()  # unpicklable, as a real session is

    def pre(self, module, args):
        self.calls.append("pre")

    def post(self, module, args, output):
        self.calls.append("post")


def user_hook(module, args, output):
    return None


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())


def copies(model: torch.nn.Module) -> list[torch.nn.Module]:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    saved = buffer.getvalue()
    assert b"traceml" not in saved
    pickled = pickle.dumps(model)
    assert b"traceml" not in pickled
    return [
        pickle.loads(pickled),
        copy.deepcopy(model),
        copy.copy(model),
        torch.load(io.BytesIO(saved), weights_only=False),
    ]


@pytest.mark.parametrize("always_call", [False, True])
def test_the_hooks_time_the_forward_and_copies_do_not_carry_them(always_call):
    model = make()
    user = model.register_forward_hook(user_hook)
    untraced = sorted(vars(model))
    timer = Timer()
    undo = add_forward_hooks(model, timer.pre, timer.post, always_call=always_call)
    model(torch.ones(1, 3))
    assert timer.calls == ["pre", "post"]
    for twin in copies(model):
        assert type(twin) is torch.nn.Sequential
        assert sorted(vars(twin)) == untraced
        assert list(twin._forward_hooks.values()) == [user_hook]
        assert not twin._forward_pre_hooks and not twin._forward_hooks_always_called
        twin(torch.ones(1, 3))
    assert timer.calls == ["pre", "post"]  # the copies never call traceml
    undo()
    assert sorted(vars(model)) == untraced
    assert list(model._forward_hooks.values()) == [user_hook]
    model(torch.ones(1, 3))
    assert timer.calls == ["pre", "post"]
    user.remove()
    assert not model._forward_hooks


def test_two_traced_trainings_on_one_module_undo_in_any_order():
    model = make()
    first, second = Timer(), Timer()
    undo_first = add_forward_hooks(model, first.pre, first.post)
    undo_second = add_forward_hooks(model, second.pre, second.post)
    for twin in copies(model):
        assert not twin._forward_hooks and "__getstate__" not in vars(twin)
    undo_first()  # not the newest: its getstate stays in the chain, harmlessly
    for twin in copies(model):
        assert not twin._forward_hooks and "__getstate__" not in vars(twin)
    undo_second()
    model(torch.ones(1, 3))
    assert first.calls == second.calls == []
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert "__getstate__" not in vars(model)


def test_a_users_own_instance_getstate_is_kept():
    model = make()

    def users_getstate():
        state = type(model).__getstate__(model)
        state = dict(state)
        state["users_mark"] = True
        return state

    model.__dict__["__getstate__"] = users_getstate
    timer = Timer()
    undo = add_forward_hooks(model, timer.pre, timer.post)
    twin = copy.deepcopy(model)
    assert twin.users_mark is True and not twin._forward_hooks
    undo()
    assert model.__dict__["__getstate__"] is users_getstate


def test_the_module_is_freed_as_soon_as_the_user_drops_it():
    model = make()
    timer = Timer()
    undo = add_forward_hooks(model, timer.pre, timer.post)  # kept: a loop's lasts to exit
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None  # no cycle through the module's own __dict__, nor the undo
    finally:
        gc.enable()
    undo()  # nothing left to take away: no error


class Refuses(torch.nn.Linear):
    """A user module that refuses to be pickled, with its own error."""

    def __getstate__(self):
        raise TypeError("this model is not for pickling")


def test_the_users_own_pickling_error_reaches_the_user_unchanged():
    model = Refuses(2, 2)
    timer = Timer()
    undo = add_forward_hooks(model, timer.pre, timer.post)
    with pytest.raises(TypeError, match="this model is not for pickling"):
        pickle.dumps(model)
    undo()
    assert "__getstate__" not in vars(model)


# -- the instance-level forward (wrap_forward / wrap_forward_once): no hooks at all --------


class Recursive(torch.nn.Module):
    """A module whose forward calls itself once (the one-door wrapper counts the outer call)."""

    def forward(self, x, again: bool = True):
        return self(x, again=False) if again else x * 2


def one_door(model, calls):
    ticks = iter(range(100, 10_000, 100))
    # The start and the end of each outermost call: (100, 200), (300, 400)...
    # The log gets ("door", start, end), one tuple per outermost call.
    return wrap_forward_once(
        model, lambda: next(ticks), lambda event: calls.append(event[1]), "door"
    )


def two_doors(model, calls):
    return wrap_forward(model, lambda: calls.append("before"), lambda: calls.append("after"))


@pytest.mark.parametrize("wrap", [one_door, two_doors])
def test_the_wrapped_forward_is_timed_and_no_copy_carries_it(wrap):
    model = make()
    user = model.register_forward_hook(user_hook)
    untraced = sorted(vars(model))
    signature = inspect.signature(model.forward)
    calls: list = []
    undo = wrap(model, calls)
    assert not model._forward_pre_hooks  # torch's fast call path: no hook of traceml's
    out = model(torch.ones(1, 3))
    assert calls in ([100], ["before", "after"])
    assert out.shape == (1, 2)
    assert inspect.signature(model.forward) == signature  # what HF and Lightning read
    assert model.forward.__name__ == "forward"
    timed = list(calls)
    for twin in copies(model):
        assert sorted(vars(twin)) == untraced
        assert list(twin._forward_hooks.values()) == [user_hook]
        twin(torch.ones(1, 3))
    assert calls == timed  # the copies never call traceml
    undo()
    assert sorted(vars(model)) == untraced
    model(torch.ones(1, 3))
    assert calls == timed
    user.remove()


def test_one_door_counts_a_forward_inside_itself_once_and_times_a_raising_one():
    model = Recursive()
    starts: list[int] = []
    undo = one_door(model, starts)
    assert model(torch.ones(2)).tolist() == [2.0, 2.0]
    assert starts == [100]  # the inner call is part of the outer one
    with pytest.raises(TypeError):
        model(None)  # the user's error inside the forward, as it would be untraced
    assert starts == [100, 300]
    model(torch.ones(2))
    assert starts == [100, 300, 500]  # the depth came back to 0 after the error
    undo()


class Varargs(torch.nn.Module):
    def forward(self, *inputs, scale=2):
        return inputs[0] * scale


@pytest.mark.parametrize("make_model", [Recursive, Varargs])
def test_the_one_door_forward_takes_the_forwards_own_parameters_where_it_can(make_model):
    """A forward that names its parameters plainly gets a door with the same parameters (no
    ``*args, **kwargs`` passed on: ~0.4 us a step); any other the generic door. Either is timed,
    keeps the forward's defaults, and refuses arguments with the untraced call's own error."""
    import inspect

    model = make_model()
    untraced_signature = inspect.signature(model.forward)
    with pytest.raises(TypeError) as untraced:
        model(torch.ones(2), 1, 2, 3, nope=1)
    starts: list[int] = []
    undo = one_door(model, starts)
    door = type(model).__dict__["forward"]
    exact = make_model is Recursive
    assert (door.__code__.co_argcount == 3) is exact
    assert (door.__code__.co_filename == "<traceml door>") is exact
    assert inspect.signature(model.forward) == untraced_signature
    assert model(torch.ones(2)).tolist() == [2.0, 2.0]
    assert starts == [100]
    with pytest.raises(TypeError) as traced:
        model(torch.ones(2), 1, 2, 3, nope=1)
    assert str(traced.value) == str(untraced.value)
    undo()
    assert type(model).__dict__["forward"] is not door


def test_one_door_leaves_a_forward_inside_backward_to_backward():
    class Inside:
        depth = 0

    model = make()
    starts: list[int] = []
    inside = Inside()
    undo = wrap_forward_once(model, lambda: 7, lambda event: starts.append(event[1]), "d", inside)
    inside.depth = 1  # the strategy's backward is running: a recomputation
    model(torch.ones(1, 3))
    assert starts == []
    inside.depth = 0
    model(torch.ones(1, 3))
    assert starts == [7]
    undo()


def test_a_forward_kept_by_the_user_logs_nothing_after_the_undo():
    # A callback that keeps ``model.forward`` while traced (an EMA helper, a closure) holds
    # traceml's wrapper: after the undo it must run the forward untimed, or its log grows for
    # as long as they call it (130 bytes a call on a real fit, found by review).
    model = Recursive()
    starts: list[int] = []
    undo = one_door(model, starts)
    kept = model.forward
    assert kept(torch.ones(2)).tolist() == [2.0, 2.0]
    assert starts == [100]
    undo()
    assert "forward" not in vars(model)
    for _ in range(3):
        assert kept(torch.ones(2)).tolist() == [2.0, 2.0]
    assert starts == [100]


def test_an_undo_during_the_forward_leaves_its_later_calls_untimed():
    starts: list[int] = []
    undo = None

    class Undoing(torch.nn.Module):  # the forward turns tracing off (a failure elsewhere)
        def forward(self, x):
            undo()
            return x + 1

    model = Undoing()
    undo = one_door(model, starts)
    kept = model.forward
    assert kept(torch.ones(1)).tolist() == [2.0]
    assert starts == [100]  # the call in progress is logged once, as it began timed
    kept(torch.ones(1))
    assert starts == [100]


def test_the_users_own_instance_forward_is_called_and_given_back():
    model = make()
    seen = []

    def users_forward(x):
        seen.append("user")
        return type(model).forward(model, x)

    model.__dict__["forward"] = users_forward
    calls: list = []
    undo = two_doors(model, calls)
    model(torch.ones(1, 3))
    assert seen == ["user"] and calls == ["before", "after"]
    twin = copy.copy(model)
    assert twin.__dict__["forward"] is users_forward  # theirs, in the copy as it would be
    undo()
    assert model.__dict__["forward"] is users_forward


def test_a_forward_the_user_replaces_during_training_stays_theirs():
    model = make()
    calls: list = []
    undo = one_door(model, calls)

    def replacement(x):
        return x

    model.forward = replacement
    undo()
    assert model.forward is replacement


def test_the_wrapped_module_is_freed_as_soon_as_the_user_drops_it():
    model = make()
    one_door(model, [])
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None  # the wrapper holds the module weakly: no cycle through __dict__
    finally:
        gc.enable()


class CopiesItself(torch.nn.Linear):
    """A user module with its own __deepcopy__ (it might copy __dict__ as is, wrapper and all)."""

    def __deepcopy__(self, memo):
        return CopiesItself(self.in_features, self.out_features)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script's deprecation
def test_only_a_plain_method_forward_on_a_getstate_copied_class_is_wrapped():
    assert can_wrap_forward(make())
    assert not can_wrap_forward(CopiesItself(2, 2))  # hooks, as before
    assert not can_wrap_forward(torch.jit.script(torch.nn.Linear(2, 2)))
    model = make()
    model.__dict__["forward"] = lambda x: x  # the user's own instance forward: called by ours
    assert can_wrap_forward(model)


lightning = pytest.importorskip("lightning.pytorch")


class HookedModule(lightning.LightningModule):  # module level: pickled by the test
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.seen: list = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(batch_idx)
        return "theirs"


def test_a_door_before_a_lightning_module_hook_runs_first_and_no_copy_carries_it():
    module, timer = HookedModule(), Timer()
    untraced = sorted(vars(module))
    signature = inspect.signature(module.on_train_batch_end)
    assert can_wrap_forward(module, "on_train_batch_end")

    def before(*args):
        timer.calls.append(("before", args, list(module.seen)))

    undo = call_before_method(module, "on_train_batch_end", functools.partial(before, "trainer"))
    door = type(module).__dict__["on_train_batch_end"]
    assert door.__code__.co_filename == "<traceml door>"  # its parameters: none passed on as *args
    assert module.on_train_batch_end(None, None, 7) == "theirs"
    assert timer.calls == [("before", ("trainer",), [])]  # before the user's hook runs
    assert module.seen == [7]
    assert inspect.signature(module.on_train_batch_end) == signature
    for twin in copies(module):
        assert sorted(vars(twin)) == untraced
        twin.on_train_batch_end(None, None, 8)
    assert len(timer.calls) == 1  # the copies never call traceml
    undo()
    assert sorted(vars(module)) == untraced
    module.on_train_batch_end(None, None, 9)
    assert len(timer.calls) == 1


def test_a_door_before_the_users_own_instance_hook_calls_theirs_and_gives_it_back():
    module, calls = HookedModule(), []

    def theirs(outputs, batch, batch_idx):  # set on the instance by the user
        calls.append(("theirs", batch_idx))
        return "own"

    module.on_train_batch_end = theirs
    assert can_wrap_forward(module, "on_train_batch_end")
    undo = call_before_method(module, "on_train_batch_end", lambda: calls.append("before"))
    assert module.on_train_batch_end(None, None, batch_idx=3) == "own"
    assert calls == ["before", ("theirs", 3)]
    assert module.seen == []  # the class's hook is not called: theirs replaced it
    undo()
    assert module.__dict__["on_train_batch_end"] is theirs


def clock(x: torch.Tensor) -> torch.Tensor:  # a user global named as a timing helper might be
    return x * 2


class Scriptable(torch.nn.Module):  # module level: its source is read by TorchScript
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clock(self.linear(x))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script's deprecation
@pytest.mark.parametrize("wrap", [one_door, two_doors])
def test_on_the_class_forward_stays_a_bound_method_that_pickles_and_scripts(wrap):
    model, other = Scriptable(), Scriptable()
    untraced = sorted(vars(model))
    expected = model(torch.ones(1, 3))
    calls: list = []
    undo = wrap(model, calls)
    bound = model.forward
    assert inspect.ismethod(bound) and bound.__self__ is model
    assert bound.__func__ is type(model).forward and sorted(vars(model)) == untraced
    assert inspect.getsource(bound).lstrip().startswith("def forward(self, x: torch.Tensor)")
    assert type(pickle.loads(pickle.dumps(bound))).__name__ == "method"
    scripted = torch.jit.script(model)  # the user's source; `clock` is the user's global
    assert torch.equal(scripted(torch.ones(1, 3)), expected)
    timed = list(calls)
    other(torch.ones(1, 3))  # another instance of the class: straight through
    assert calls == timed
    model(torch.ones(1, 3))
    assert len(calls) > len(timed)
    assert typing.get_type_hints(bound) == typing.get_type_hints(other.forward)
    undo()
    after = list(calls)
    bound(torch.ones(1, 3))  # the bound door kept by the user: untimed after the undo
    assert calls == after
    assert not hasattr(Scriptable.forward, "__wrapped__")  # the class's own function again


class Inherits(Scriptable):  # forward is its base's: the door goes on the instance
    pass


def test_a_forward_inherited_or_of_a_torch_class_is_wrapped_on_the_instance():
    for model in (Inherits(), make()):  # make(): torch's nn.Sequential, everywhere in a process
        calls: list = []
        on_class = type(model).__dict__.get("forward")  # Sequential's own; none on Inherits
        undo = two_doors(model, calls)
        assert "forward" in vars(model) and type(model).__dict__.get("forward") is on_class
        model(torch.ones(1, 3))
        assert calls == ["before", "after"]
        undo()
        assert "forward" not in vars(model) and type(model).__dict__.get("forward") is on_class


def test_two_doors_on_one_class_undone_out_of_order_leave_the_class_as_it_was():
    original = Scriptable.__dict__["forward"]
    first, second = Scriptable(), Scriptable()
    calls: list = []
    undo_first = one_door(first, calls)
    undo_second = two_doors(second, calls)
    first(torch.ones(1, 3))
    second(torch.ones(1, 3))
    assert calls == [100, "before", "after"]
    undo_first()  # not the newest: it stays under the second door, timing nothing
    first(torch.ones(1, 3))
    assert calls == [100, "before", "after"]
    undo_second()
    assert Scriptable.__dict__["forward"] is original
