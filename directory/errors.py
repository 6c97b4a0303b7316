"""What the directory refuses, in words an operator can act on.

Each error carries a stable code and a status (reachconsole/core/errors.py); callers decide
on the class or the code, and tests compare the words to these constants.
"""

from __future__ import annotations

from reachconsole.core.errors import ConsoleError


class DirectoryError(ConsoleError):
    code = "directory_error"
    status = 400


class InvalidAlias(DirectoryError):
    code = "invalid_alias"
    status = 422


class AliasTaken(DirectoryError):
    code = "alias_taken"
    status = 409


class AliasNotFound(DirectoryError):
    code = "alias_not_found"
    status = 404


ALIAS_EMPTY = "an alias needs at least one character besides a leading @"
ALIAS_TOO_LONG = "an alias is at most {limit} characters; this one has {length}"
ALIAS_CONTROL = (
    "an alias is what people type after @: it may not contain line breaks, tabs or other "
    "control characters"
)
ALIAS_NO_NAMESPACE = (
    "namespace {namespace} of {agent_id} does not exist yet: it is made when its first agent "
    "registers, or add it under Namespaces; an alias lives in the namespace of the agent it "
    "names"
)
ALIAS_NOT_REGISTERED = (
    "Saved, but no agent {agent_id} is on the roster: @{alias} resolves to nothing until it "
    "registers. If it should be there, check the spelling."
)
ALIAS_TAKEN = "@{alias} already names {agent_id} in namespace {namespace}"
ALIAS_NOT_FOUND = "alias {alias_id} does not exist (removed meanwhile?)"
