# Django loads an app's models from `models`; the audit trail lives in core/audit.py, the
# console's identity in core/identity.py.
from reachconsole.core.audit import AuditEntry
from reachconsole.core.identity import ConsoleIdentity

__all__ = ["AuditEntry", "ConsoleIdentity"]
