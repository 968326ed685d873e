"""Tokens and text in, logits and tokens out: the API a user calls on a loaded model.

:class:`LanguageModel` is that surface, the same for a model on one hub or several
(:class:`vkxsplit.model.Model` is the one that runs): the tokenizer (``tokenize``,
``detokenize``, ``chat_ids`` through the file's chat template), teacher-forced ``logits``,
``prefill``, and generation (``generate_ids`` samples with :class:`vkxsplit.sampling.Sampler`,
or reads the GPU's argmax for greedy decoding; ``generate`` streams text). It runs the model
only through one step, ``_run`` (at most ``ubatch`` tokens appended to the context), and reads
the step's outputs from ``_out()`` (the hub share whose ``logits_buf`` / ``argmax_buf`` they land
in); the defaults are :mod:`vkxsplit.defaults`' (the command line's).

Imports: ``vkxsplit.defaults``, ``vkxsplit.errors``, ``vkxsplit.gguf_model`` (a type),
``vkxsplit.sampling``, ``vkxsplit.tokenizer``; nothing that runs on a device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from .defaults import N_PREDICT, SAMPLING, chat_default
from .errors import Closable, ModelError, VkxError
from .gguf_model import ModelFile
from .sampling import Sampler
from .tokenizer import Tokenizer


class LanguageModel(Closable):
    """Tokens and text in, logits and tokens out: the API a user calls, the same for a model on
    one hub or several (:class:`vkxsplit.model.Model`). Subclasses set ``hp``, ``n_ctx``, ``ubatch``,
    ``n_past``, ``_tokenizer``/``_tokenizer_error`` and implement ``_run`` (one step of at most
    ``ubatch`` tokens appended to the context) and ``_out`` (the hub share,
    :class:`vkxsplit.hubs.HubShare`, whose ``logits_buf``/``argmax_buf`` the step's outputs
    land in)."""

    hp: Any
    n_ctx: int
    ubatch: int
    n_past: int
    _tokenizer: Tokenizer | None
    _tokenizer_error: ModelError | None
    # after close() every public method (and a step a generator resumes) raises ClosedError
    _closed_guards = ("_run",)
    _closed_what = "model"

    def _run(self, ids: list[int], all_logits: bool) -> Any:
        raise NotImplementedError

    def _check_step(self, T: int) -> None:
        """A step of ``T`` tokens fits ``ubatch`` and the context (raises with what to do)."""
        if T > self.ubatch:
            raise VkxError(f"a step of {T} tokens is more than ubatch {self.ubatch}")
        if self.n_past + T > self.n_ctx:
            raise VkxError(f"the context is full: {self.n_past} + {T} tokens > n_ctx {self.n_ctx}",
                           "use a shorter prompt or fewer tokens, or a larger context: n_ctx= (load_model), -c (command line)")

    def _load_tokenizer(self, file: ModelFile) -> None:
        """The file's tokenizer, or the reason it has none (logits() still works on token ids;
        text needs a vocabulary)."""
        self._tokenizer, self._tokenizer_error = None, None
        try:
            self._tokenizer = Tokenizer.from_model_file(file)
        except ModelError as exc:
            self._tokenizer_error = exc

    def _out(self) -> Any:
        raise NotImplementedError

    def _read_logits(self, T: int) -> np.ndarray:
        """The logits of every row of the last step of ``T`` tokens (all_logits)."""
        return self._out().logits_buf.numpy(np.float32, (T, self.hp.n_vocab))

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.hp.n_vocab]
        if bad:
            raise VkxError(f"token id {bad[0]} is outside the vocabulary (0..{self.hp.n_vocab - 1})")

    def reset(self) -> None:
        self.n_past = 0

    def run_step(self, ids: list[int], all_logits: bool = False) -> Any:
        """Append ``ids`` (at most ``ubatch`` tokens) to the context and run one step of the
        forward pass; its logits are then what :meth:`last_logits` / :meth:`last_argmax` read
        (every row's with ``all_logits``). Returns the step (its counters, its trace)."""
        return self._run(list(ids), all_logits)

    # -- public API ---------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer (raises the file's ModelError when it has no vocabulary)."""
        if self._tokenizer is None:
            assert self._tokenizer_error is not None
            raise self._tokenizer_error
        return self._tokenizer

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def logits(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits (len(ids), n_vocab) float32 from an empty context."""
        ids = list(ids)
        self._check_ids(ids)
        if len(ids) > self.n_ctx:
            raise VkxError(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        self.reset()
        out = np.empty((len(ids), self.hp.n_vocab), np.float32)
        for s in range(0, len(ids), self.ubatch):
            chunk = ids[s:s + self.ubatch]
            self._run(chunk, all_logits=True)
            out[s:s + len(chunk)] = self._read_logits(len(chunk))
        return out

    def prefill(self, ids: list[int]) -> None:
        """Run ``ids`` through the model from an empty context (last logits kept)."""
        self._check_ids(ids)
        if not ids:
            raise VkxError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise VkxError(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx}",
                           "shorten the prompt or raise the context: n_ctx= (load_model), -c (command line)")
        self.reset()
        for s in range(0, len(ids), self.ubatch):
            self._run(ids[s:s + self.ubatch], all_logits=False)

    def last_logits(self) -> np.ndarray:
        return self._out().logits_buf.numpy(np.float32, (self.hp.n_vocab,)).copy()

    def last_argmax(self) -> int:
        out = self._out()
        views = out.__dict__.get("_io_views")
        tok = int(views[2][0] if views is not None else out.argmax_buf.numpy(np.int32, (1,))[0])
        if tok < 0:  # the GPU argmax saw a NaN or +inf (ops/argmax.py)
            raise _nonfinite_logits(self)
        return tok

    def _prepare_steps(self, n_prompt: int) -> None:
        """Plan and record the steps a generation from an ``n_prompt``-token prompt runs (with
        ``--split auto``, the planner's first-run measurements), so that no reported rate counts them."""
        executor = getattr(self, "_executor", None)
        if executor is None or n_prompt < 1 or getattr(self, "slots", 1) > 1:
            return  # (micro-batches: the pieces' executors are made at the first step)
        Ts = {min(self.ubatch, n_prompt), 1} | ({n_prompt % self.ubatch} - {0})
        for T in sorted(Ts):
            executor(T, False)

    def generate_ids(self, prompt_ids: list[int], max_tokens: int = N_PREDICT,
                     temperature: float = SAMPLING.temperature, top_k: int = SAMPLING.top_k,
                     top_p: float = SAMPLING.top_p, seed: int | None = None,
                     stop_ids: set[int] | None = None, min_p: float = SAMPLING.min_p,
                     repeat_penalty: float = SAMPLING.repeat_penalty,
                     repeat_last_n: int = SAMPLING.repeat_last_n) -> Iterator[int]:
        """Yield generated token ids: until an end-of-turn token, ``max_tokens`` tokens, or a full
        context (``max_tokens=-1``: no limit but the context). ``timings`` then holds the
        counts, the seconds (planning and first-run measurements apart, in ``setup_s``) and
        ``stop``: ``"eos"``, ``"length"`` or ``"context"``. Defaults: :mod:`vkxsplit.defaults`."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < -1:
            raise VkxError(f"max_tokens must be a whole number >= -1, got {max_tokens!r}",
                           "-1 generates until the end of generation or a full context")
        sampler = Sampler(temperature, top_k, top_p, seed, min_p=min_p, repeat_penalty=repeat_penalty,
                          repeat_last_n=repeat_last_n)
        stop = self.tokenizer.eot_ids if stop_ids is None else stop_ids
        history = list(prompt_ids)
        self.timings = {"prompt_tokens": len(prompt_ids), "gen_tokens": 0, "stop": "length"}
        ts = time.perf_counter()
        if 0 < len(prompt_ids) < self.n_ctx:
            self._prepare_steps(len(prompt_ids))
        self.timings["setup_s"] = time.perf_counter() - ts
        t0 = time.perf_counter()
        self.prefill(list(prompt_ids))
        self.timings["prompt_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        i = 0
        while max_tokens < 0 or i < max_tokens:
            if not sampler.needs_logits:
                tok = self.last_argmax()
            else:
                logits = self.last_logits()
                if not np.isfinite(logits).all() and (np.isnan(logits).any() or np.isposinf(logits).any()):
                    raise _nonfinite_logits(self)
                tok = sampler.sample(logits, history)
            if tok in stop:
                self.timings["stop"] = "eos"
                break
            i += 1
            self.timings["gen_tokens"] = i
            history.append(tok)
            yield tok
            if i == max_tokens:
                break
            if self.n_past + 1 >= self.n_ctx:
                self.timings["stop"] = "context"
                break
            self._run([tok], all_logits=False)
        self.timings["gen_s"] = time.perf_counter() - t1

    def chat_ids(self, prompt: str | list[dict[str, str]], chat: bool | None = None,
                 system: str | None = None) -> list[int]:
        """The prompt's token ids: ``prompt`` (text, or chat messages ``[{"role", "content"}]``)
        through the file's chat template when ``chat`` (default: exactly when the file has a
        template; messages always are), with ``system`` as a first system message."""
        if chat is None:
            chat = not isinstance(prompt, str) or chat_default(self.tokenizer)
        if not chat:
            if not isinstance(prompt, str):
                raise VkxError("chat messages need the chat template: chat=False takes text only")
            return self.tokenize(((system + "\n\n") if system else "") + prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system:
            messages = [{"role": "system", "content": system}] + messages
        return self.tokenizer.encode_chat(messages)

    def generate(self, prompt: str | list[dict[str, str]], max_tokens: int = N_PREDICT,
                 temperature: float = SAMPLING.temperature, seed: int | None = None, chat: bool | None = None,
                 top_k: int = SAMPLING.top_k, top_p: float = SAMPLING.top_p, min_p: float = SAMPLING.min_p,
                 repeat_penalty: float = SAMPLING.repeat_penalty, repeat_last_n: int = SAMPLING.repeat_last_n,
                 system: str | None = None) -> Iterator[str]:
        """Yield text pieces of the continuation of ``prompt`` (text, or chat messages); a chat
        turn when ``chat`` (default: exactly when the file has a chat template). Other defaults:
        :mod:`vkxsplit.defaults`, the same as the command line's."""
        ids = self.chat_ids(prompt, chat, system)
        yield from self.tokenizer.decode_stream(self.generate_ids(
            ids, max_tokens, temperature, top_k, top_p, seed, min_p=min_p, repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n))

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> LanguageModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def _nonfinite_logits(model: LanguageModel) -> ModelError:
    where = getattr(model, "path", None)
    return ModelError(f"the logits of {where.name if where else 'the model'} are not finite (NaN or "
                      "infinity): the model file most likely holds non-finite weights",
                      "check the file (e.g. gguf's dequantize of each tensor for NaN or inf) or fetch it again")


__all__ = ["LanguageModel"]
