# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The attributes text every hsx.recovery module shares (`extends_documentation_fragment:
hsx.recovery.attributes`), written once here instead of copied into each module's DOCUMENTATION.

ansible-doc merges a fragment's `attributes` under the module's own, key by key, the module's keys
winning: a module states only `support` (and `details`, what it does in that mode) for check_mode and
diff_mode; `platform` (posix, full) comes whole from here unless a module says more. Built into the
collection as plugins/doc_fragments/attributes.py (tools/collection/build.py)."""

from __future__ import annotations


class ModuleDocFragment:
    """The fragment `hsx.recovery.attributes` (its DOCUMENTATION)."""

    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
  platform:
    description: Target OS/families that can be operated against.
    support: full
    platforms: posix
"""

    # `hsx.recovery.attributes.facts`: for a module that sets facts (as ansible.builtin's
    # action_common_attributes.facts), so the other modules show no facts attribute.
    FACTS = r"""
options: {}
attributes:
  facts:
    description: Action returns an C(ansible_facts) dictionary that will update existing host facts.
    support: full
"""
