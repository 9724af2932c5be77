"""CUDA-event bookkeeping with fake events: lazy reads, ordering, draining, memory window."""

import orjson

from traceml import schema
from traceml.capture.cuda_timing import CudaStepTimer
from traceml.step_record import StepRecord


class FakeDevice:
    """A device clock that lags the host: events complete when the test says so."""

    def __init__(self):
        self.now = 0.0
        self.completed_until = -1.0
        self.synchronized = 0


class FakeEvent:
    def __init__(self, device: FakeDevice):
        self.device = device
        self.time = None

    def record(self):
        self.time = self.device.now

    def query(self):
        return self.time is not None and self.time <= self.device.completed_until

    def synchronize(self):
        self.device.synchronized += 1
        self.device.completed_until = max(self.device.completed_until, self.time)

    def elapsed_time(self, end):
        return end.time - self.time


def make_timer(device, peaks=None):
    state = {"resets": 0}
    return (
        CudaStepTimer(
            new_event=lambda: FakeEvent(device),
            reset_peak=lambda: state.__setitem__("resets", state["resets"] + 1),
            peak_allocated=lambda: (peaks or [100])[0],
            peak_reserved=lambda: (peaks or [100, 200])[-1],
        ),
        state,
    )


def counting_timer(device):
    """A timer without memory readings, and the list of every event it made."""
    created = []

    def new_event():
        created.append(FakeEvent(device))
        return created[-1]

    return CudaStepTimer(new_event=new_event), created


def one_step(timer, device, start):
    device.now = start
    timer.step_started()
    for phase, begin, end in (("h2d", 1, 2), ("forward", 3, 7), ("backward", 8, 16)):
        device.now = start + begin
        timer.phase_started(phase)
        device.now = start + end
        timer.phase_ended(phase)
    device.now = start + 17
    timer.phase_started("optimizer")
    device.now = start + 20
    record = StepRecord(i=start)  # as the step clock makes it: short keys, read by name
    timer.step_ended(record)
    return record


def test_records_wait_until_the_device_has_finished_them():
    device = FakeDevice()
    timer, state = make_timer(device)
    one_step(timer, device, 0)
    assert list(timer.ready()) == []  # nothing completed: no blocking, no record
    assert timer.queued == 1
    device.completed_until = 20
    (record,) = list(timer.ready())
    assert record[schema.GPU_STEP] == 20
    assert record[schema.GPU_H2D] == 1
    assert record[schema.GPU_FORWARD] == 4
    assert record[schema.GPU_BACKWARD] == 8
    assert record[schema.GPU_OPTIMIZER] == 3
    assert record[schema.MEM_PEAK_ALLOCATED] == 100
    assert record[schema.MEM_PEAK_RESERVED] == 200
    assert state["resets"] == 1
    assert device.synchronized == 0


def test_ready_returns_finished_steps_in_order_and_drain_waits_for_the_rest():
    device = FakeDevice()
    timer, _ = make_timer(device)
    one_step(timer, device, 0)
    one_step(timer, device, 100)
    one_step(timer, device, 200)
    device.completed_until = 110  # first step (0..20) done, second (100..120) not
    assert [r["step"] for r in timer.ready()] == [0]
    assert [r["step"] for r in timer.drain()] == [100, 200]
    assert device.synchronized == 2
    assert timer.queued == 0


def test_events_are_reused_after_a_step_is_read():
    device = FakeDevice()
    timer, created = counting_timer(device)
    one_step(timer, device, 0)
    device.completed_until = 1000
    list(timer.ready())
    first_round = len(created)
    one_step(timer, device, 100)
    assert len(created) == first_round  # pooled, not allocated again


def test_accumulated_microbatches_sum_their_intervals():
    device = FakeDevice()
    timer, _ = make_timer(device)
    device.now = 0
    timer.step_started()
    for start in (0, 10):
        device.now = start + 1
        timer.phase_started("forward")
        device.now = start + 4
        timer.phase_ended("forward")
        timer.step_started()  # second microbatch of the same step: no new window
    device.now = 30
    record = StepRecord()
    timer.step_ended(record)
    device.completed_until = 30
    (done,) = list(timer.ready())
    assert done[schema.GPU_FORWARD] == 6
    assert done[schema.GPU_STEP] == 30


def test_a_step_ended_at_its_last_phase_leaves_the_validation_after_it_out():
    """Microbatches left without an optimizer step at an epoch's end are closed after the
    validation that followed them (the any-loop learns of the epoch's end at the next epoch's
    first forward): their device step ends with their last phase, as their host step does."""
    device = FakeDevice()
    timer, created = counting_timer(device)
    device.now = 0
    timer.step_started()
    for phase, begin, end in (("forward", 1, 4), ("backward", 4, 9)):
        device.now = begin
        timer.phase_started(phase)
        device.now = end
        timer.phase_ended(phase)
    device.now = 500  # the validation's device work, then the epoch is known to be over
    record = StepRecord()
    timer.step_ended(record, at_last_phase=True)
    device.completed_until = 500
    (done,) = list(timer.ready())
    assert done[schema.GPU_STEP] == 9 and done[schema.GPU_BACKWARD] == 5
    # No end event of its own: the backward's end, recycled once (twice, two later events
    # would be the same one).
    assert len(created) == 5 and len({id(event) for event in timer._free}) == 5


def test_abandoned_step_is_never_reported():
    device = FakeDevice()
    timer, _ = make_timer(device)
    timer.step_started()
    timer.phase_started("forward")
    timer.abandon_step()
    timer.step_ended({})
    assert timer.queued == 0


def comm_step(device, intervals, backward=(8, 16)):
    """One step (0..20) whose backward holds the device comm ``intervals`` (start, end)."""
    timer = CudaStepTimer(new_event=lambda: FakeEvent(device), comm_enabled=True)
    device.now = 0
    timer.step_started()
    device.now = backward[0]
    timer.phase_started("backward")
    for start, end in intervals:
        device.now = start
        first = timer.mark()
        device.now = end
        timer.add_comm(schema.BACKWARD, first, timer.mark())
    device.now = backward[1]
    timer.phase_ended("backward")
    device.now = 20
    record = StepRecord()
    timer.step_ended(record)
    device.completed_until = 20
    (done,) = list(timer.ready())
    return done


def test_overlapping_waits_are_merged_not_summed():
    # Two async collectives in flight together, waited on one after the other.
    done = comm_step(FakeDevice(), [(9, 13), (11, 15), (15, 16)])
    assert done[schema.GPU_COMM_OF_PHASE[schema.BACKWARD]] == 7  # 9..16, not 4 + 4 + 1
    assert done[schema.GPU_COMM] == 7


def test_a_phases_device_own_time_is_never_negative():
    # A wait that began before the phase did (an event recorded on another stream's behalf)
    # cannot make the phase's waiting longer than the phase.
    done = comm_step(FakeDevice(), [(2, 15)])
    assert done[schema.GPU_BACKWARD] == 8
    assert done[schema.GPU_COMM_OF_PHASE[schema.BACKWARD]] <= done[schema.GPU_BACKWARD]
    assert done[schema.GPU_COMM] <= done[schema.GPU_STEP]


def test_device_times_are_whole_microseconds_and_phases_that_did_not_wait_are_left_out():
    done = comm_step(FakeDevice(), [(9.1234567, 13.0000004)])
    assert done[schema.GPU_COMM] == 3.877 and done[schema.GPU_BACKWARD] == 8
    forward_wait = schema.GPU_COMM_OF_PHASE[schema.FORWARD]
    assert forward_wait not in done and done[forward_wait] == 0.0  # absent, read back as 0
    assert len(orjson.dumps(done)) < 120  # short keys, no 17-digit floats


def test_events_go_on_the_models_device_stream_not_the_current_devices():
    """A model on cuda:1 in a process that never set the device: ``event.record()`` alone
    would record on cuda:0's stream (timing nothing of the model's, and making a CUDA context
    on GPU 0 that the user never asked for)."""
    from traceml.capture.cuda_timing import cuda_step_timer

    recorded = []

    class RecordingEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            recorded.append(stream)

    class Cuda:  # torch.cuda's part the timer uses
        Event = RecordingEvent

        @staticmethod
        def current_stream(device=None):
            return ("stream of", device)

    timer = cuda_step_timer("cuda:1", cuda=Cuda)
    timer.step_started()
    timer.phase_started(schema.FORWARD)
    timer.phase_ended(schema.FORWARD)
    assert recorded == [("stream of", "cuda:1")] * 3
