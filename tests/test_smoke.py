from conftest import get_messages, subscribe


def test_paho_roundtrip_v5_and_v311(broker, clients):
    sub = clients(broker.port, version=5)
    assert subscribe(sub, "smoke/#", 1)[0].value == 1
    pub = clients(broker.port, version=4)
    pub.publish("smoke/a", b"one", qos=1).wait_for_publish(5)
    [m] = get_messages(sub, 1)
    assert (m.topic, m.payload, m.qos) == ("smoke/a", b"one", 1)
