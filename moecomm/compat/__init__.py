"""Other libraries' APIs on moecomm: :mod:`moecomm.compat.deep_ep` (DeepEP's low-latency subset; imports torch)."""
