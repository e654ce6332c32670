// recurformer-logits: the engine's logits for a prompt of token ids, then greedy tokens, for the
// parity tests (tests/test_engine.py). Built by engine/build.sh against the patched libllama.
//
//   recurformer-logits MODEL.gguf TOKENS.bin N_PREDICT OUT.bin [N_UBATCH] [N_THREADS] [FLASH_ATTN]
//
// TOKENS.bin: int32 token ids. OUT.bin: int32 n_prompt, int32 n_predict, int32 n_vocab, then the
// float32 logits of every prompt position [n_prompt, n_vocab], then for each greedy step its
// int32 token and the float32 logits that chose it ([n_vocab]). The KV cache is F32; the prompt
// is decoded in ubatches of N_UBATCH tokens (default 512), so a window's ring buffer is exercised.
// FLASH_ATTN (default 0): 1 takes flash attention, which reads the cache as F16 on the CPU.

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

static void quiet(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static bool write_all(FILE * f, const void * data, size_t size) {
    return fwrite(data, 1, size, f) == size;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS.bin N_PREDICT OUT.bin [N_UBATCH] [N_THREADS] [FLASH_ATTN]\n", argv[0]);
        return 2;
    }
    const int n_predict = atoi(argv[3]);
    const int n_ubatch  = argc > 5 ? atoi(argv[5]) : 512;
    const int n_threads = argc > 6 ? atoi(argv[6]) : 2;
    const bool flash    = argc > 7 && atoi(argv[7]) != 0;

    std::vector<llama_token> prompt;
    {
        FILE * f = fopen(argv[2], "rb");
        if (!f) {
            fprintf(stderr, "error: cannot read %s\n", argv[2]);
            return 2;
        }
        llama_token id;
        while (fread(&id, sizeof(id), 1, f) == 1) {
            prompt.push_back(id);
        }
        fclose(f);
    }
    if (prompt.empty()) {
        fprintf(stderr, "error: %s holds no token\n", argv[2]);
        return 2;
    }

    llama_log_set(quiet, nullptr);
    llama_backend_init();

    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", argv[1]);
        return 1;
    }

    const int n_prompt = (int) prompt.size();

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = n_prompt + n_predict;
    cparams.n_batch         = n_prompt;
    cparams.n_ubatch        = n_ubatch;
    cparams.n_seq_max       = 1;
    cparams.n_threads       = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.type_k          = GGML_TYPE_F32;
    cparams.type_v          = GGML_TYPE_F32;
    cparams.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;

    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "error: cannot create a context\n");
        return 1;
    }

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    FILE * out = fopen(argv[4], "wb");
    if (!out) {
        fprintf(stderr, "error: cannot write %s\n", argv[4]);
        return 2;
    }
    const int header[3] = { n_prompt, n_predict, n_vocab };
    bool ok = write_all(out, header, sizeof(header));

    llama_batch batch = llama_batch_init(n_prompt, 0, 1);
    for (int i = 0; i < n_prompt; ++i) {
        batch.token[i]     = prompt[i];
        batch.pos[i]       = i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i]    = true;
    }
    batch.n_tokens = n_prompt;

    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "error: the prompt failed to decode\n");
        return 1;
    }
    for (int i = 0; ok && i < n_prompt; ++i) {
        ok = write_all(out, llama_get_logits_ith(ctx, i), sizeof(float) * n_vocab);
    }

    const float * logits = llama_get_logits_ith(ctx, n_prompt - 1);
    for (int step = 0; ok && step < n_predict; ++step) {
        llama_token best = 0;
        for (int v = 1; v < n_vocab; ++v) {
            if (logits[v] > logits[best]) {
                best = v;
            }
        }
        ok = write_all(out, &best, sizeof(best)) && write_all(out, logits, sizeof(float) * n_vocab);

        llama_batch next = llama_batch_get_one(&best, 1);
        if (ok && step + 1 < n_predict) {
            if (llama_decode(ctx, next) != 0) {
                fprintf(stderr, "error: step %d failed to decode\n", step);
                return 1;
            }
            logits = llama_get_logits_ith(ctx, -1);
        }
    }

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);

    if (fclose(out) != 0 || !ok) {
        fprintf(stderr, "error: cannot write %s\n", argv[4]);
        return 1;
    }
    return 0;
}
