"""Reading the Django admin's pages in tests: messages shown, a change form as posted back,
an action a user without the change permission is refused."""

from __future__ import annotations

from typing import Any

#: How the line every action ends with starts: what still needs an operator.
LEFT = ("Still needing attention: ", "Nothing else needs attention now.")


def shown(response: Any) -> list[str]:
    """The admin messages a response carries, as the operator reads them, without the
    closing "what is left" line (see :func:`left`)."""
    return [str(m) for m in response.context["messages"] if not str(m).startswith(LEFT)]


def left(response: Any) -> list[str]:
    """The closing "what is left" line(s) of an action's answer."""
    return [str(m) for m in response.context["messages"] if str(m).startswith(LEFT)]


def form_data(page: Any) -> dict[str, Any]:
    """What a browser posts back for the change form as rendered (unchanged)."""
    form = page.context["adminform"].form
    data: dict[str, Any] = {}
    for name in form.fields:
        value = form[name].value()
        data[name] = "" if value is None else value
    return data


def requeue_refused_to_a_viewer(view_permission: str, changelist: str, pk: Any) -> None:
    """A staff user with only ``view_permission`` is not offered the ``requeue_dead``
    action on ``changelist``, and posting it for row ``pk`` anyway is refused (the
    caller checks the row is unchanged)."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission
    from django.test import Client

    user = get_user_model().objects.create_user("clerk", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename=view_permission))
    client = Client()
    client.force_login(user)
    page = client.get(changelist)
    assert page.status_code == 200
    form = page.context["action_form"]
    choices = dict(form.fields["action"].choices) if form is not None else {}
    assert "requeue_dead" not in choices
    client.post(changelist, {"action": "requeue_dead", "_selected_action": [pk], "post": "yes"})
