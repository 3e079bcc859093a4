"""Checkpoint permissions: the official ``openai`` SDK shares a checkpoint with another
tenant, which can then use it (completions, ``/v1/models``) until the permission goes;
only the owner (or an admin) manages them."""

from __future__ import annotations

import openai
import pytest

from control.jobs.lifecycle import transition
from tests.api.test_chat_completions import (  # noqa: F401 (engine, serving: fixtures)
    MESSAGES,
    _sdk,
    engine,
    job_with_adapters,
    serving,
)


def test_a_shared_checkpoint_serves_the_other_tenant_until_its_permission_is_deleted(
    request, tenant_key, make_job, db_session, client, settings
) -> None:
    owner, friend = tenant_key(), tenant_key()
    row, _output, step = job_with_adapters(client, db_session, settings, make_job(owner.headers)["id"])
    scripted, base_url = request.getfixturevalue("engine"), request.getfixturevalue("serving")()
    oai, theirs = _sdk(base_url, owner.key), _sdk(base_url, friend.key)
    name = oai.fine_tuning.jobs.checkpoints.list(row.id).data[0].fine_tuned_model_checkpoint

    def friend_can_use_it() -> bool:
        listed = name in {m.id for m in theirs.models.list()}
        try:
            answer = theirs.chat.completions.create(model=name, messages=MESSAGES)
        except openai.NotFoundError as caught:
            assert caught.code == "model_not_found" and not listed
            return False
        assert listed and answer.model == name and scripted.requests[-1].adapter.path == f"{step}/adapter"
        assert theirs.models.retrieve(name).owned_by == owner.tenant_id
        return True

    assert not friend_can_use_it()
    granted = oai.fine_tuning.checkpoints.permissions.create(name, project_ids=[friend.tenant_id]).data
    assert [(p.object, p.project_id) for p in granted] == [("checkpoint.permission", friend.tenant_id)]
    assert [p.id for p in oai.fine_tuning.checkpoints.permissions.list(name)] == [granted[0].id]
    assert friend_can_use_it()
    with pytest.raises(openai.PermissionDeniedError):  # it is theirs to use, not to share on
        theirs.fine_tuning.checkpoints.permissions.list(name)

    deleted = oai.fine_tuning.checkpoints.permissions.delete(granted[0].id, fine_tuned_model_checkpoint=name)
    assert (deleted.id, deleted.object, deleted.deleted) == (granted[0].id, "checkpoint.permission", True)
    assert not friend_can_use_it()
    assert oai.fine_tuning.checkpoints.permissions.list(name).data == []


def test_only_the_owner_or_an_admin_manages_the_permissions_of_real_tenants(
    client, tenant_key, make_job, db_session, settings
) -> None:
    owner, first, second, stranger, admin = (tenant_key(), tenant_key(), tenant_key(), tenant_key(),
                                             tenant_key(admin=True))
    row, _output, _step = job_with_adapters(client, db_session, settings, make_job(owner.headers)["id"])
    name = f"{row.fine_tuned_model}:ckpt-step-2"
    path = f"/v1/fine_tuning/checkpoints/{name}/permissions"

    def error(answer) -> tuple[int, str, str | None]:
        body = answer.json()["error"]
        return answer.status_code, body["code"], body["param"]

    for project_ids, expected in (([first.tenant_id, "org-nobody"], (400, "invalid_project_id", "project_ids[1]")),
                                  ([owner.tenant_id], (400, "invalid_project_id", "project_ids[0]")),
                                  ([], (400, "invalid_request", "project_ids"))):
        assert error(client.post(path, headers=owner.headers, json={"project_ids": project_ids})) == expected
    for who in (stranger, first):
        assert error(client.post(path, headers=who.headers, json={"project_ids": [who.tenant_id]}))[:2] == (
            404, "not_found")
    missing = f"/v1/fine_tuning/checkpoints/{row.fine_tuned_model}:ckpt-step-9/permissions"
    assert error(client.get(missing, headers=owner.headers)) == (404, "not_found", "fine_tuned_model_checkpoint")

    made = client.post(path, headers=owner.headers, json={"project_ids": [first.tenant_id, first.tenant_id]})
    assert [p["project_id"] for p in made.json()["data"]] == [first.tenant_id]
    again = client.post(path, headers=admin.headers, json={"project_ids": [second.tenant_id, first.tenant_id]})
    assert again.status_code == 200, again.text
    assert again.json()["data"][1]["id"] == made.json()["data"][0]["id"]  # granting is idempotent
    page = client.get(path, headers=owner.headers, params={"limit": 1, "order": "ascending"}).json()
    assert [p["project_id"] for p in page["data"]] == [first.tenant_id] and page["has_more"]
    rest = client.get(path, headers=owner.headers, params={"after": page["last_id"], "order": "ascending"}).json()
    assert [p["project_id"] for p in rest["data"]] == [second.tenant_id] and not rest["has_more"]
    only = client.get(path, headers=admin.headers, params={"project_id": second.tenant_id}).json()
    assert [p["project_id"] for p in only["data"]] == [second.tenant_id]
    permission = only["data"][0]["id"]
    assert error(client.delete(f"{path}/{permission}", headers=second.headers))[:2] == (403, "permission_denied")
    assert error(client.delete(f"{path}/cp-nope", headers=owner.headers)) == (404, "not_found", "permission_id")

    # The job's final model is shared by its own name, once the job has made it.
    final = f"/v1/fine_tuning/checkpoints/{row.fine_tuned_model}/permissions"
    assert client.post(final, headers=owner.headers, json={"project_ids": [second.tenant_id]}).status_code == 404
    transition(db_session, row, "succeeded", actor="executor")
    db_session.commit()
    assert client.post(final, headers=owner.headers, json={"project_ids": [second.tenant_id]}).status_code == 200
    models = {m["id"] for m in client.get("/v1/models", headers=second.headers).json()["data"]}
    assert {name, row.fine_tuned_model} <= models
    assert not {name, row.fine_tuned_model} & {m["id"] for m in client.get("/v1/models", headers=stranger.headers)
                                               .json()["data"]}
