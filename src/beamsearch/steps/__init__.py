"""Every way of running a model step beside the generic one, and the gate each must pass (gate.py)."""
