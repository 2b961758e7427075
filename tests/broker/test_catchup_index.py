"""The catch-up's index (broker/catchup.py, "The index"), in-process over a log kept in lists:
an offline session reads only the records it needs, and with or without the index it delivers
exactly what a reading of every record would, in log order per partition."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshmq.broker import catchup as catchup_module
from meshmq.broker.catchup import CatchUp, index_restored
from meshmq.broker.message import Message
from meshmq.broker.session import Subscription
from meshmq.log.errors import CorruptSegment
from meshmq.log.record import Record
from meshmq.mqtt.packets import SubscriptionOptions
from meshmq.mqtt.topics import topic_matches


class ListLog:
    """A ``PartitionLog`` of records in lists, counting the records read."""

    def __init__(self, partitions: int, led: set[int] | None = None) -> None:
        self.records: list[list[Record]] = [[] for _ in range(partitions)]
        self.high_watermark = [0] * partitions
        self.led = set(range(partitions)) if led is None else led
        self.records_read = 0

    def add(self, partition: int, topic: str) -> int:
        """Append a record and route it (the high watermark passes it); returns its offset."""
        offset = len(self.records[partition])
        record = Record.new(topic, f"{partition}:{offset}".encode(), 0, qos=1)
        record.offset = offset
        self.records[partition].append(record)
        self.high_watermark[partition] = offset + 1
        return offset

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        found = self.records[partition][offset:offset + max_records]
        self.records_read += len(found)
        return found

    def routes_all(self, partition: int) -> bool:
        return partition in self.led

    def views_known(self) -> bool:
        return True

    def earliest_offset(self, partition: int) -> int:
        return 0


SUBSCRIPTION = Subscription(SubscriptionOptions(qos=1))


def read_all(catchup: CatchUp, filters: list[str]) -> list[tuple[int, int]]:
    """Step until finished; the (partition, offset) of each message delivered."""
    got: list[tuple[int, int]] = []

    def deliver(message: Message, subscription: Subscription, dup: bool) -> bool:
        assert message.position is not None
        got.append(message.position)
        return True

    subscriptions = dict.fromkeys(filters, SUBSCRIPTION)
    while not catchup.finished:
        catchup.step(1000, subscriptions, deliver, 0.0)
    return got


def route(log_: ListLog, catchup: CatchUp, partition: int, topic: str,
          filters: list[str]) -> None:
    """What the router does for an offline session: a record whose topic matches one of the
    session's subscriptions reaches ``Session.deliver``, which asks ``covers``."""
    offset = log_.add(partition, topic)
    if any(topic_matches(f, topic) for f in filters):
        assert catchup.covers(topic, (partition, offset))


def test_an_offline_device_reads_only_its_own_messages() -> None:
    log_ = ListLog(4)
    filters = ["dev/7/cmd"]
    catchup = CatchUp(log_)  # type: ignore[arg-type]
    catchup.add(filters[0], None, list(log_.high_watermark))  # it went offline here
    for n in range(2000):  # the fleet's traffic; device 7's command every 500th
        route(log_, catchup, n % 4, f"dev/{n % 500}/cmd", filters)
    got = read_all(catchup, filters)
    assert got == [(3, 1), (3, 126), (3, 251), (3, 376)]  # n = 7, 507, 1007, 1507
    assert log_.records_read == 4


def test_a_partition_led_elsewhere_is_read_in_full() -> None:
    log_ = ListLog(2, led={0})
    filters = ["dev/+/cmd"]
    catchup = CatchUp(log_)  # type: ignore[arg-type]
    catchup.add(filters[0], None, list(log_.high_watermark))
    for n in range(100):
        route(log_, catchup, n % 2, "dev/1/cmd" if n % 20 in (0, 1) else "other", filters)
    got = read_all(catchup, filters)
    assert sorted(got) == [(p, offset) for p in (0, 1) for offset in range(0, 50, 10)]
    assert log_.records_read == 5 + 50  # partition 0: its 5 listed; partition 1: all 50


def test_start_up_index_lists_what_restored_sessions_need() -> None:
    """Sessions restored with cursors from a past run (nothing noted): one read of the log
    lists each one's records; each then reads only those."""
    log_ = ListLog(2)
    for n in range(1000):
        log_.add(n % 2, f"dev/{n % 100}/cmd")
    catchups = {}
    for device in range(100):
        catchup = CatchUp(log_)  # type: ignore[arg-type]
        catchup.add(f"dev/{device}/cmd", None, list(log_.high_watermark))
        catchup.filters[0].start = [250, 250]  # its cursor as stored
        catchups[device] = catchup
    read = index_restored(list(catchups.values()), log_,  # type: ignore[arg-type]
                          lambda topic: [catchups[int(topic.split("/")[1])]])
    assert read == 500  # offsets 250 to 499 of both partitions, once
    log_.records_read = 0
    got = read_all(catchups[42], ["dev/42/cmd"])
    assert got == [(0, offset) for offset in range(271, 500, 50)]  # n = 542, 642, ... 942
    assert log_.records_read == len(got)


# ("route", partition, topic index) | ("replay", start, 0) | ("back", partition, how far)
Action = tuple[str, int, int]
TOPICS = ["a/x", "a/y", "b/x", "b/y"]
FILTERS = ["a/+", "+/x", "#"]


@settings(max_examples=300, deadline=None)
@given(
    led=st.sets(st.integers(0, 2)),
    filter_index=st.integers(0, len(FILTERS) - 1),
    index_max=st.integers(1, 6),
    actions=st.lists(st.one_of(
        st.tuples(st.just("route"), st.integers(0, 2), st.integers(0, len(TOPICS) - 1)),
        st.tuples(st.just("replay"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("back"), st.integers(0, 2), st.integers(0, 5)),
    ), max_size=60),
)
def test_the_index_never_changes_what_is_delivered(
        led: set[int], filter_index: int, index_max: int, actions: list[Action]) -> None:
    """Against a reading of every record: the same messages, in log order per partition,
    whatever is led here, however the index overflows, with replays from the past and starts
    moved back (a session falling back to the log) along the way."""
    original = catchup_module.INDEX_MAX
    catchup_module.INDEX_MAX = index_max
    try:
        log_ = ListLog(3, led)
        first = FILTERS[filter_index]
        filters = [first]
        catchup = CatchUp(log_)  # type: ignore[arg-type]
        catchup.add(first, None, list(log_.high_watermark))
        starts = {first: list(log_.high_watermark)}  # the reference: per filter, per partition
        for kind, a, b in actions:
            if kind == "route":
                route(log_, catchup, a, TOPICS[b], filters)
            elif kind == "replay":  # a second filter from a past offset (a replay request)
                start = [min(a, high) for high in log_.high_watermark]
                catchup.add("b/+", None, start)
                starts["b/+"] = list(start)
                filters = [first, "b/+"]
            else:  # a start moved back by b (Session._fall_back_to_log)
                back = max(0, log_.high_watermark[a] - b)
                for f in catchup.filters:
                    f.start[a] = min(f.start[a], back)
                    starts[f.topic_filter][a] = min(starts[f.topic_filter][a], back)
                catchup.read_in_full_below(a, log_.high_watermark[a])
        expected = sorted(
            (partition, record.offset)
            for partition, records in enumerate(log_.records) for record in records
            if any(topic_matches(f, record.topic) and record.offset >= start[partition]
                   for f, start in starts.items()))
        got = read_all(catchup, filters)
        assert sorted(got) == expected
        for partition in range(3):  # log order within each partition
            offsets = [offset for p, offset in got if p == partition]
            assert offsets == sorted(offsets)
    finally:
        catchup_module.INDEX_MAX = original


def test_a_finished_catch_up_knows_the_late_copies_of_what_it_read() -> None:
    """A copy of a record can come live after the catch-up read it (its view passed a record
    still on its way, cluster/remotelog.py): it is recognised as read, in the range the
    catch-up read only, and once a copy past that range came in a partition, no more are
    looked for there."""
    log_ = ListLog(2)
    for _ in range(3):
        log_.add(0, "a/1")
    catchup = CatchUp(log_)
    catchup.add("a/#", None, [1, 0])  # began at offset 1 of partition 0
    assert read_all(catchup, ["a/#"]) == [(0, 1), (0, 2)]
    assert catchup.read_already("a/1", (0, 2)) and catchup.read_already("a/1", (0, 1))
    assert not catchup.read_already("a/1", (0, 0))  # below where it began: never read
    assert not catchup.read_already("b/1", (0, 2))  # another filter's: not read here
    assert not catchup.read_already("a/1", (1, 0))  # a partition it read nothing of
    assert not catchup.tail_passed
    assert not catchup.read_already("a/1", (0, 3))  # live past what it read
    assert catchup.tail_passed
    assert not catchup.read_already("a/1", (0, 2))


def test_a_catch_up_under_way_knows_what_it_read_already() -> None:
    log_ = ListLog(1)
    for _ in range(4):
        log_.add(0, "a/1")
    catchup = CatchUp(log_)
    catchup.add("a/#", None, [0])
    catchup.step(2, dict.fromkeys(["a/#"], SUBSCRIPTION), lambda m, s, d: True, 0.0)
    assert not catchup.finished
    assert catchup.read_before("a/1", 0, 1)  # read: a copy of it now comes twice
    assert not catchup.read_before("a/1", 0, 2)  # still to read
    assert catchup.covers("a/1", (0, 3))


def test_a_read_that_fails_stops_that_partition_there_and_harms_nothing_else() -> None:
    """Damaged stored bytes (or a view ahead of the log): the catch-up delivers the other
    partitions, skips nothing of the failing one, raises nothing (the error would reach the
    loop and close the connection or mesh link whose event woke the session), and reads on
    from there once the log reads again."""
    log_ = ListLog(2, led=set())
    filters = ["dev/#"]
    catchup = CatchUp(log_)  # type: ignore[arg-type]
    catchup.add(filters[0], None, [0, 0])
    for n in range(6):
        route(log_, catchup, n % 2, "dev/1", filters)
    healthy = log_.read
    failing = [True]

    def read(partition: int, offset: int, max_records: int) -> list[Record]:
        if partition == 1 and failing[0]:
            raise CorruptSegment(f"{partition}/00000000.log", 0, "checksum mismatch")
        return healthy(partition, offset, max_records)

    log_.read = read  # type: ignore[method-assign]
    got: list[tuple[int, int]] = []

    def deliver(message: Message, subscription: Subscription, dup: bool) -> bool:
        assert message.position is not None
        got.append(message.position)
        return True

    for _ in range(3):
        catchup.step(1000, {"dev/#": SUBSCRIPTION}, deliver, 0.0)
    assert got == [(0, 0), (0, 1), (0, 2)] and not catchup.finished
    assert catchup.cursor() == [3, 0]
    failing[0] = False
    got += read_all(catchup, filters)
    assert got == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
