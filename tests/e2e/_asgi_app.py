"""The smallest ASGI application, for uvicorn worker processes that should start in a moment
(tests/e2e/test_serve.py's supervisor test): no model, no torch."""


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
