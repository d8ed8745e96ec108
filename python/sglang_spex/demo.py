"""``make demo``: start the default server (SmolLM2 on CPU SGLang, --tot-speculation), ask it, shut down."""

from __future__ import annotations

import argparse
import time

import requests

from sglang_spex.serve import ServerProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--question", default="What is 12 + 7? Answer briefly.")
    args = ap.parse_args()
    t0 = time.monotonic()
    with ServerProcess(["--tot-speculation"]) as srv:
        print(f"server ready in {time.monotonic() - t0:.0f}s at {srv.url}")
        info = requests.get(srv.url + "/spex/info").json()
        print(f"plugin loaded in scheduler pid {info['scheduler']['pid']}: {info['plugin_loaded_in_scheduler']}")
        body = {
            "text": f"<|im_start|>user\n{args.question}<|im_end|>\n<|im_start|>assistant\n",
            "sampling_params": {"max_new_tokens": 48, "temperature": 0},
        }
        out = requests.post(srv.url + "/generate", json=body, timeout=300).json()
        print(f"Q: {args.question}\nA: {out['text'].strip()}")
    print("server stopped")


if __name__ == "__main__":
    main()
