"""The hand-off from serving threads to the collector: nothing lost, nothing reordered
per producer, and a sleeping consumer woken by the put, not by its timeout."""

import threading
import time

from dsv4_idxk_probe.background import HandOff


def test_items_come_out_in_order():
    hand_off = HandOff()
    for i in range(5):
        hand_off.put(i)
    assert [hand_off.get() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert len(hand_off.items) == 0


def test_a_sleeping_consumer_is_woken_by_the_put():
    hand_off, got = HandOff(), []
    consumer = threading.Thread(target=lambda: got.append((hand_off.get(check_every_s=30), time.monotonic())))
    consumer.start()
    deadline = time.monotonic() + 5
    while not hand_off._sleeping and time.monotonic() < deadline:  # the consumer is waiting
        time.sleep(0.001)
    put_at = time.monotonic()
    hand_off.put("work")
    consumer.join(5)
    assert got and got[0][0] == "work"
    assert got[0][1] - put_at < 2  # the bell, not the 30 s timeout


def test_many_producers_lose_nothing():
    hand_off, received = HandOff(), []
    producers, per_producer = 4, 2000

    def produce(p):
        for i in range(per_producer):
            hand_off.put((p, i))
            if i % 97 == 0:
                time.sleep(0.0005)  # let the consumer drain and sleep now and then

    def consume():
        for _ in range(producers * per_producer):
            received.append(hand_off.get(check_every_s=30))

    consumer = threading.Thread(target=consume)
    consumer.start()
    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    consumer.join(60)
    assert not consumer.is_alive() and len(received) == producers * per_producer
    for p in range(producers):
        assert [i for q, i in received if q == p] == list(range(per_producer))  # each producer's order kept
