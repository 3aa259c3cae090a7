import httpx
from tests.server.fake_engine import FakeClef
from tests.server.test_mcp import INITIALIZE, JSON_ACCEPT

def test_probe(live_fake):
    served = live_fake(FakeClef(), max_body_bytes=2048)
    bodies = {
        "no method": {"jsonrpc": "2.0", "id": 1},
        "bad version": {**INITIALIZE, "jsonrpc": "1.0"},
        "params list": {**INITIALIZE, "params": [1]},
        "tools/call params str": {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": "x"},
        "tools/call no name": {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {}},
        "array": [1, 2],
        "empty obj": {},
    }
    for name, body in bodies.items():
        r = httpx.post(served.url + "/mcp", json=body, headers=JSON_ACCEPT)
        print("\n==", name, r.status_code, r.headers.get("content-type"), r.text[:1500])
    for name, raw in {"not json": b"{nope", "big": b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"' + b"a"*5000 + b'"}}'}.items():
        r = httpx.post(served.url + "/mcp", content=raw, headers={**JSON_ACCEPT, "content-type": "application/json"})
        print("\n==", name, r.status_code, r.headers.get("content-type"), r.text[:1500])
