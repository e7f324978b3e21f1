"""[[hook]]: `wrenmq serve` loads hook classes named in its configuration (assemble.py).

The hook is the example package in examples/hooks/ (acme_hooks.Gatekeeper), loaded by
`wrenmq serve` in a subprocess; clients are paho and raw sockets.
"""

import json
import subprocess

import pytest

from conftest import ROOT, WRENMQ, get_messages, subscribe
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Connect

HOOKS_DIR = ROOT / "examples" / "hooks"


def hook_config(options='refused_prefixes = ["test-"]\nsite = "plant-7"\nwrap_topics = ["sensors/#"]',
                module="acme_hooks:Gatekeeper", path=str(HOOKS_DIR)):
    return f"""
[storage]
mode = "memory"

[[hook]]
module = "{module}"
path = "{path}"
[hook.options]
{options}
"""


def test_example_config_names_the_example_package():
    """examples/hooks.toml loads acme_hooks from the folder beside it (`config check` imports it)."""
    r = subprocess.run([WRENMQ, "config", "check", str(ROOT / "examples" / "hooks.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout


def test_hook_from_config_refuses_a_client_and_transforms_a_message(serve_broker, raw_client, clients):
    b = serve_broker(hook_config())

    refused = raw_client(b.port, version=C.MQTT5)
    refused.send(Connect(client_id="test-device", version=C.MQTT5))
    connack = refused.recv()
    assert connack.reason_code == C.NOT_AUTHORIZED
    assert refused.closed()

    sub = clients(b.port, client_id="dashboard")
    subscribe(sub, "sensors/#", 1)
    subscribe(sub, "other/#", 1)
    pub = clients(b.port, client_id="device-1")
    pub.publish("sensors/t1", b"21.5", qos=1).wait_for_publish(5)
    pub.publish("other/x", b"untouched", qos=1).wait_for_publish(5)
    got = {m.topic: m.payload for m in get_messages(sub, 2)}
    assert json.loads(got["sensors/t1"]) == {"site": "plant-7", "value": "21.5"}
    assert got["other/x"] == b"untouched"


@pytest.mark.parametrize("module, options, says", [
    ("no_such_module:Hook", "", "hook[0] no_such_module:Hook: cannot import no_such_module"),
    ("acme_hooks:Missing", "", "has no Missing"),
    ("acme_hooks:json", "", "json is not a subclass of wrenmq.broker.hooks.Hook"),
    ("acme_hooks:Gatekeeper", "colour = 1", "raised at start: TypeError"),
])
def test_a_hook_that_cannot_load_stops_the_start_naming_it(tmp_path, module, options, says):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(hook_config(options, module=module) + "\n[[listener]]\nport = 0\n")
    r = subprocess.run([WRENMQ, "serve", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert says in r.stderr, r.stderr
    if options == "":
        check = subprocess.run([WRENMQ, "config", "check", str(cfg)], capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 2 and says in check.stderr, check.stderr


def test_a_hook_whose_start_raises_stops_the_broker(tmp_path):
    (tmp_path / "failing_hook.py").write_text(
        "from wrenmq.broker.hooks import Hook\n"
        "class NeedsDatabase(Hook):\n"
        "    async def start(self, broker):\n"
        "        raise ConnectionRefusedError('database at 127.0.0.1:1 refused')\n")
    cfg = tmp_path / "start.toml"
    cfg.write_text(hook_config("", module="failing_hook:NeedsDatabase", path=".") +
                   "\n[[listener]]\nport = 0\n")
    r = subprocess.run([WRENMQ, "serve", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert "hook failing_hook:NeedsDatabase failed to start: ConnectionRefusedError" in r.stderr, r.stderr
