"""Every write to namespaces an operator asks for (the admin calls these): created, described,
opened to or closed to other namespaces, removed. Each is checked here and audited in its
own transaction.

Registration creates the namespace of a new agent by itself (services.agent_register); a
namespace's name never changes afterwards, because every agent id in it begins with it.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from reachconsole.core.audit import audit_record
from roster import errors
from roster.errors import InvalidNamespace, NamespaceNotFound, NamespaceTaken
from roster.models import NAMESPACE_RE, Namespace


def namespace_name_check(raw: Any) -> str:
    """A namespace name as agent ids use it (`fin` in `fin.tax`), or InvalidNamespace."""
    if not isinstance(raw, str) or not NAMESPACE_RE.fullmatch(raw):
        raise InvalidNamespace(errors.NAMESPACE_INVALID.format(raw=str(raw)[:100]))
    return raw


def namespace_create(*, name: Any, description: str = "", open_to_other_namespaces: bool = False,
                     actor: str) -> Namespace:
    name = namespace_name_check(name)
    try:
        with transaction.atomic():
            namespace = Namespace.objects.create(
                name=name, description=description,
                open_to_other_namespaces=open_to_other_namespaces,
            )
            audit_record(actor=actor, action="namespace_create", target=name,
                         detail=f"open_to_other_namespaces={open_to_other_namespaces}")
    except IntegrityError:
        raise NamespaceTaken(errors.NAMESPACE_TAKEN.format(name=name)) from None
    return namespace


def namespace_update(*, name: str, actor: str, description: str | None = None,
                     open_to_other_namespaces: bool | None = None) -> Namespace:
    """Change what is given (None leaves a field as it is). A change that changes nothing
    writes nothing, not even an audit row: a bulk action over a mixed selection audits only
    the namespaces it flipped."""
    with transaction.atomic():
        namespace = Namespace.objects.select_for_update().filter(name=name).first()
        if namespace is None:
            raise NamespaceNotFound(errors.NAMESPACE_NOT_FOUND.format(name=name))
        changes, fields = [], []
        if description is not None and description != namespace.description:
            namespace.description = description
            changes.append("description changed")
            fields.append("description")
        if (open_to_other_namespaces is not None
                and open_to_other_namespaces != namespace.open_to_other_namespaces):
            # Isolation decides who may send to whom (directory/routing.py): always audited
            # with both values.
            changes.append(f"open_to_other_namespaces {namespace.open_to_other_namespaces} → "
                           f"{open_to_other_namespaces}")
            namespace.open_to_other_namespaces = open_to_other_namespaces
            fields.append("open_to_other_namespaces")
        if fields:
            namespace.save(update_fields=fields)
            audit_record(actor=actor, action="namespace_update", target=name,
                         detail="; ".join(changes))
    return namespace


def namespace_delete(*, name: str, actor: str) -> None:
    """Remove a namespace and its aliases. One that still has agents is refused by the
    database (PROTECT): deregister them first."""
    with transaction.atomic():
        namespace = Namespace.objects.select_for_update().filter(name=name).first()
        if namespace is None:
            raise NamespaceNotFound(errors.NAMESPACE_NOT_FOUND.format(name=name))
        namespace.delete()
        audit_record(actor=actor, action="namespace_delete", target=name)
