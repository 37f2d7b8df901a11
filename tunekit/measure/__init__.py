"""How a candidate is judged: the device (``device``), the ONE correctness path (``verify``) and the ONE
timing path (``bench``). Search, serving checks and evidence all measure through these three modules.
"""
