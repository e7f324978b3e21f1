"""Network framing below MQTT that is not MQTT: the PROXY protocol header (proxy.py)."""
