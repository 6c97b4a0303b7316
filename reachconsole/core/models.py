# Django loads an app's models from `models`; the audit trail lives in core/audit.py.
from reachconsole.core.audit import AuditEntry

__all__ = ["AuditEntry"]
