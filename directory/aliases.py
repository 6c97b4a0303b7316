"""Every write to aliases (the admin calls these): each alias is checked here the same way
whoever writes it, and each change is audited in its own transaction.

An alias is what people type after @ (`@资金日报`) for one agent. It lives in the namespace
of the agent it names (taken from the agent id), unique there. It may name an agent that is
not registered yet, so that aliases can be set up before a deployment starts its agents;
the writer is then told so (`AliasFields.registered`, a warning in the admin, a note in the
audit), and the resolver says so when someone uses it (directory/resolver.py). A typo is
seen at once rather than at the first mention.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction

from directory import errors
from directory.errors import AliasNotFound, AliasTaken, InvalidAlias
from directory.models import Alias, alias_normalize
from reachconsole.core.audit import audit_record
from roster.ids import agent_id_parse
from roster.models import Agent, Namespace

ALIAS_MAX = Alias._meta.get_field("alias").max_length


@dataclass(frozen=True, slots=True)
class AliasFields:
    alias: str
    agent_id: str
    namespace: Namespace
    registered: bool  # whether the agent it names is on the roster now


def alias_check(*, alias: Any, agent_id: Any, alias_id: int | None = None) -> AliasFields:
    """The alias as it is stored (no leading @, the agent id in its dotted form, the agent's
    namespace), or a refusal with words: InvalidAlias, InvalidAgentId (the roster's rule for
    agent ids) or AliasTaken."""
    text = alias_normalize(alias if isinstance(alias, str) else "")
    if not text:
        raise InvalidAlias(errors.ALIAS_EMPTY)
    if len(text) > ALIAS_MAX:
        raise InvalidAlias(errors.ALIAS_TOO_LONG.format(limit=ALIAS_MAX, length=len(text)))
    if any(unicodedata.category(ch) == "Cc" for ch in text):
        raise InvalidAlias(errors.ALIAS_CONTROL)
    ref = agent_id_parse(agent_id)
    namespace = Namespace.objects.filter(name=ref.namespace).first()
    if namespace is None:
        raise InvalidAlias(errors.ALIAS_NO_NAMESPACE.format(
            agent_id=ref.agent_id, namespace=ref.namespace), code="alias_no_namespace")
    taken = (Alias.objects.filter(namespace=namespace, alias=text).exclude(pk=alias_id)
             .values_list("agent_id", flat=True).first())
    if taken is not None:
        raise AliasTaken(errors.ALIAS_TAKEN.format(alias=text, agent_id=taken,
                                                   namespace=namespace.name))
    return AliasFields(alias=text, agent_id=ref.agent_id, namespace=namespace,
                       registered=Agent.objects.filter(agent_id=ref.agent_id).exists())


def _named(fields: AliasFields) -> str:
    return f"→ {fields.agent_id}" + ("" if fields.registered else " (not on the roster)")


def _target(alias: Alias) -> str:
    return f"{alias.namespace.name}:{alias.alias}"


def _taken(fields: AliasFields) -> AliasTaken:
    # The unique constraint caught what alias_check could not see yet (a concurrent write).
    return AliasTaken(errors.ALIAS_TAKEN.format(alias=fields.alias, agent_id="another agent",
                                                namespace=fields.namespace.name))


def alias_create(*, alias: Any, agent_id: Any, actor: str) -> tuple[Alias, AliasFields]:
    """The stored alias, and what was checked (`registered`: say so when it is not)."""
    fields = alias_check(alias=alias, agent_id=agent_id)
    try:
        with transaction.atomic():
            row = Alias.objects.create(alias=fields.alias, agent_id=fields.agent_id,
                                       namespace=fields.namespace)
            audit_record(actor=actor, action="alias_create", target=_target(row),
                         detail=_named(fields))
    except IntegrityError:
        raise _taken(fields) from None
    return row, fields


def alias_update(*, alias_id: int, alias: Any, agent_id: Any, actor: str
                 ) -> tuple[Alias, AliasFields]:
    fields = alias_check(alias=alias, agent_id=agent_id, alias_id=alias_id)
    try:
        with transaction.atomic():
            row = (Alias.objects.select_for_update(of=("self",)).select_related("namespace")
                   .filter(pk=alias_id).first())
            if row is None:
                raise AliasNotFound(errors.ALIAS_NOT_FOUND.format(alias_id=alias_id))
            before = {"alias": row.alias, "agent_id": row.agent_id,
                      "namespace": row.namespace.name}
            after = {"alias": fields.alias, "agent_id": fields.agent_id,
                     "namespace": fields.namespace.name}
            changes = [f"{key} {before[key]} → {after[key]}" for key in before
                       if before[key] != after[key]]
            if changes:
                row.alias, row.agent_id, row.namespace = (fields.alias, fields.agent_id,
                                                          fields.namespace)
                row.save(update_fields=["alias", "agent_id", "namespace"])
                if not fields.registered:
                    changes.append(f"{fields.agent_id} is not on the roster")
                audit_record(actor=actor, action="alias_update", target=_target(row),
                             detail="; ".join(changes))
    except IntegrityError:
        raise _taken(fields) from None
    return row, fields


def alias_delete(*, alias_id: int, actor: str) -> None:
    with transaction.atomic():
        row = (Alias.objects.select_for_update(of=("self",)).select_related("namespace")
               .filter(pk=alias_id).first())
        if row is None:
            raise AliasNotFound(errors.ALIAS_NOT_FOUND.format(alias_id=alias_id))
        target = _target(row)
        row.delete()
        audit_record(actor=actor, action="alias_delete", target=target,
                     detail=f"named {row.agent_id}")
