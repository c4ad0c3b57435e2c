"""The reward service: rewards scored over HTTP (msgpack or JSON, PNG pixels; never pickle).

protocol.py   the wire format (PROTOCOL_VERSION, encode_request / decode_request, ...)
server.py     the aiohttp service: `make_app(scorers)`, `serve(settings, rm_types, host, port)`
client.py     `RemoteRewardClient(url, reward, ...)`: batching, retries, waiting for a service that is down
"""
