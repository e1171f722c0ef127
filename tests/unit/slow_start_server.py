"""A server for `test_bench_server_start.py`: waits DELAY seconds, leaves a child in a session of its own (as the
platform's workers are), writes the child's pid to PIDFILE, then serves streaming completions on PORT.

    python slow_start_server.py PORT DELAY PIDFILE
"""

import subprocess
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lorafaas.testing.fake_completions import completion_stream


async def completions(request: Request):
    body = await request.json()
    if body["model"] != "m":
        return JSONResponse({"error": {"message": f"model {body['model']} does not exist"}}, status_code=404)
    return completion_stream(body["max_tokens"])


if __name__ == "__main__":
    port, delay, pidfile = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    time.sleep(delay)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    with open(pidfile, "w") as f:
        f.write(str(child.pid))
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
