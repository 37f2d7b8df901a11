"""Test-only (on PYTHONPATH for the fixed-timing searches): with TUNEKIT_TEST_VENDOR_MS set, the vendor
baseline sleeps that long after each call, so every candidate of tests/fixed_time_backend.py beats it and
the tables of those searches are decided by the candidates' fixed costs alone."""

import os

_MS = os.environ.get("TUNEKIT_TEST_VENDOR_MS")
if _MS:
    import time

    from tunekit.backends import vendor as _vendor

    _build = _vendor.VendorBackend.build

    def _slow_build(self, problem, params, device):
        kernel = _build(self, problem, params, device)

        def slow(inputs, out):
            kernel(inputs, out)
            time.sleep(float(_MS) / 1000)

        return slow

    _vendor.VendorBackend.build = _slow_build
