// MQTT.js interop: subscribe through one URL, publish through another, check the message.
//
//   node mqttjs_roundtrip.js SUB_URL PUB_URL PROTOCOL_VERSION [CAFILE]
//
// URLs are mqtt://, mqtts://, ws:// or wss:// (MQTT.js picks the transport from the
// scheme). Prints one JSON line and exits 0 when the QoS 1 message came back, 1 otherwise.
"use strict";

const fs = require("fs");
const mqtt = require("mqtt");

const [subUrl, pubUrl, version, cafile] = process.argv.slice(2);
const base = { protocolVersion: Number(version), connectTimeout: 5000, reconnectPeriod: 0 };
if (cafile) base.ca = fs.readFileSync(cafile);

const tag = `${process.pid}-${Date.now()}`;
const topic = `mqttjs/${tag}/t`;
const payload = `hello from MQTT.js (MQTT ${version})`;
const clients = [];
let finished = false;

function done(code, result) {
  if (finished) return; // ending the clients below may report "Connection closed"
  finished = true;
  (code === 0 ? console.log : console.error)(JSON.stringify(result));
  for (const c of clients) c.end(true);
  process.exit(code);
}

const timer = setTimeout(() => done(1, { ok: false, error: "timeout" }), 10000);

function connect(url, clientId) {
  const c = mqtt.connect(url, { ...base, clientId });
  c.on("error", (err) => done(1, { ok: false, error: String(err), url }));
  clients.push(c);
  return c;
}

const sub = connect(subUrl, `js-sub-${tag}`);
sub.on("connect", () => {
  sub.subscribe(topic, { qos: 1 }, (err, granted) => {
    if (err) return done(1, { ok: false, error: String(err) });
    sub.on("message", (t, msg, packet) => {
      if (t !== topic) return;
      clearTimeout(timer);
      done(0, { ok: true, topic: t, payload: msg.toString(), qos: packet.qos, granted: granted[0].qos });
    });
    const pub = connect(pubUrl, `js-pub-${tag}`);
    pub.on("connect", () => {
      pub.publish(topic, payload, { qos: 1 }, (e) => {
        if (e) done(1, { ok: false, error: String(e) });
      });
    });
  });
});
