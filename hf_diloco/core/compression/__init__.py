"""What a vector becomes on the wire: the codecs and the registry every list of codecs derives from (`codecs.py`),
low-rank PowerSGD compression (`lowrank.py`) and the adaptive policy that picks rank and codec (`adaptive.py`).

Floor 1: may import `layout`.
"""
