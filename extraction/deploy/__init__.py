"""What the hosts install, built on the control node (`hsx wheelhouse`, the hsx role's deploy).

wheelhouse: this package's wheel plus every pinned runtime dependency, with one digest that
tells a host whether it must install anything.
"""
