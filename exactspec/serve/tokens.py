"""/tokenize and /detokenize, in vLLM's shapes, on the front's tokenizer.

POST /tokenize {"prompt": str, "add_special_tokens": true} or {"messages": [...]} (rendered
through the chat template, as chat completions are) -> {"count", "max_model_len", "tokens"}
(and "token_strs" with "return_token_strs": true). POST /detokenize {"tokens": [ids]} ->
{"prompt": text}. "model", when given, must be the served one (404 otherwise).
"""

from __future__ import annotations

from exactspec.models.loading import Model
from exactspec.serve.fields import ApiError, bad, bool_field, check_size, is_id, utf8_size
from exactspec.serve.messages import chat_prompt
from exactspec.serve.rows import token_strings


def _model(body: object, served_name: str, model: Model) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    name = body.get("model")
    if name is not None and name != served_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                       f"{served_name!r}", param="model", code="model_not_found")
    if model.tokenizer is None:
        raise bad("this model has no tokenizer: send and read token ids", None)
    return body


def tokenize(body: object, model: Model, served_name: str, max_bytes: int | None) -> dict:
    """The body's prompt (or chat messages) as token ids."""
    body = _model(body, served_name, model)
    if body.get("messages") is not None:
        (ids,) = chat_prompt(body, model, max_bytes)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string (or send 'messages')", "prompt")
        check_size(utf8_size(prompt, "prompt"), max_bytes, "prompt", model)
        special = bool_field(body, "add_special_tokens", True)
        ids = (model.encode(prompt) if special else
               list(model.tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    out = {"count": len(ids), "max_model_len": model.max_context, "tokens": ids}
    if bool_field(body, "return_token_strs", False):
        out["token_strs"] = token_strings(model.tokenizer, ids)
    return out


def detokenize(body: object, model: Model, served_name: str) -> dict:
    """The body's token ids as text (special tokens kept, as vLLM does)."""
    body = _model(body, served_name, model)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(is_id(t) and t < model.vocab_size for t in ids):
        raise bad(f"'tokens' must be a list of token ids in [0, {model.vocab_size})", "tokens")
    return {"prompt": model.tokenizer.decode(ids)}
