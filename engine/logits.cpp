// recurformer-logits: the engine's logits for a prompt of token ids, then greedy tokens, for the
// parity tests (tests/test_engine.py). Built by engine/build.sh against the patched libllama.
//
//   recurformer-logits MODEL.gguf TOKENS.bin N_PREDICT OUT.bin [options]
//     --ubatch N        tokens per ubatch (default 512): a window's ring buffer wraps across them
//     --batch N         tokens per llama_decode call (default: the whole prompt in one call)
//     --first-output P  ask for the logits of prompt positions P.. only (default 0: every position),
//                       as llama-perplexity (the second half) and llama-server (the last) ask
//     --cache-type T    the KV caches' type: f32 (default), f16, q8_0, q4_0
//     --flash           flash attention (on the CPU it reads an f32 cache as f16)
//     --swa-full        a sliding-window cache as large as the context (default: the window's own
//                       size, as llama.cpp's tools make it, so that its ring wraps)
//     --threads N       (default 2)
//     --restore-at K    after K greedy steps, save the sequence's state (llama_state_seq_get_data),
//                       clear the memory, restore the state (llama_state_seq_set_data) and go on
//
// TOKENS.bin: int32 token ids. OUT.bin: int32 n_prompt, int32 first_output, int32 n_predict,
// int32 n_vocab, then the float32 logits of prompt positions first_output.. [n_prompt -
// first_output, n_vocab], then for each greedy step its int32 token and the float32 logits that
// chose it ([n_vocab]).

#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void quiet(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static bool write_all(FILE * f, const void * data, size_t size) {
    return fwrite(data, 1, size, f) == size;
}

static bool cache_type(const std::string & name, ggml_type & type) {
    const std::pair<const char *, ggml_type> known[] = {
        {"f32", GGML_TYPE_F32}, {"f16", GGML_TYPE_F16}, {"q8_0", GGML_TYPE_Q8_0}, {"q4_0", GGML_TYPE_Q4_0},
    };
    for (const auto & [n, t] : known) {
        if (name == n) {
            type = t;
            return true;
        }
    }
    return false;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS.bin N_PREDICT OUT.bin [--ubatch N] [--batch N] "
                        "[--first-output P] [--cache-type T] [--flash] [--threads N]\n", argv[0]);
        return 2;
    }
    const int n_predict = atoi(argv[3]);
    int n_ubatch = 512, n_batch = 0, first_output = 0, n_threads = 2, restore_at = -1;
    bool flash = false, swa_full = false;
    ggml_type type_kv = GGML_TYPE_F32;
    for (int i = 5; i < argc; ++i) {
        const std::string arg = argv[i];
        const bool has_value = i + 1 < argc;
        if (arg == "--flash") {
            flash = true;
        } else if (arg == "--swa-full") {
            swa_full = true;
        } else if (arg == "--ubatch" && has_value) {
            n_ubatch = atoi(argv[++i]);
        } else if (arg == "--batch" && has_value) {
            n_batch = atoi(argv[++i]);
        } else if (arg == "--first-output" && has_value) {
            first_output = atoi(argv[++i]);
        } else if (arg == "--restore-at" && has_value) {
            restore_at = atoi(argv[++i]);
        } else if (arg == "--threads" && has_value) {
            n_threads = atoi(argv[++i]);
        } else if (arg == "--cache-type" && has_value) {
            if (!cache_type(argv[++i], type_kv)) {
                fprintf(stderr, "error: unknown --cache-type %s (f32, f16, q8_0, q4_0)\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "error: unknown option %s\n", argv[i]);
            return 2;
        }
    }

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
    const int n_prompt = (int) prompt.size();
    if (n_prompt == 0) {
        fprintf(stderr, "error: %s holds no token\n", argv[2]);
        return 2;
    }
    if (first_output < 0 || first_output >= n_prompt) {
        fprintf(stderr, "error: --first-output %d is not a prompt position (0..%d)\n", first_output, n_prompt - 1);
        return 2;
    }
    if (n_batch <= 0) {
        n_batch = n_prompt;
    }

    llama_log_set(quiet, nullptr);
    llama_backend_init();

    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", argv[1]);
        return 1;
    }

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = n_prompt + n_predict;
    cparams.n_batch         = n_batch;
    cparams.n_ubatch        = std::min(n_ubatch, n_batch);
    cparams.n_seq_max       = 1;
    cparams.n_threads       = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.type_k          = type_kv;
    cparams.type_v          = type_kv;
    cparams.swa_full        = swa_full;
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
    const int header[4] = { n_prompt, first_output, n_predict, n_vocab };
    bool ok = write_all(out, header, sizeof(header));

    // the prompt in calls of n_batch tokens; each call's outputs are read before the next
    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    for (int start = 0; ok && start < n_prompt; start += n_batch) {
        const int n = std::min(n_batch, n_prompt - start);
        for (int i = 0; i < n; ++i) {
            batch.token[i]     = prompt[start + i];
            batch.pos[i]       = start + i;
            batch.n_seq_id[i]  = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i]    = start + i >= first_output;
        }
        batch.n_tokens = n;
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "error: the prompt failed to decode at position %d\n", start);
            return 1;
        }
        for (int i = std::max(0, first_output - start); ok && i < n; ++i) {
            ok = write_all(out, llama_get_logits_ith(ctx, i), sizeof(float) * n_vocab);
        }
    }

    std::vector<float> logits(llama_get_logits_ith(ctx, -1), llama_get_logits_ith(ctx, -1) + n_vocab);
    for (int step = 0; ok && step < n_predict; ++step) {
        llama_token best = (llama_token) (std::max_element(logits.begin(), logits.end()) - logits.begin());
        ok = write_all(out, &best, sizeof(best)) && write_all(out, logits.data(), sizeof(float) * n_vocab);

        if (step == restore_at) {
            std::vector<uint8_t> state(llama_state_seq_get_size(ctx, 0));
            if (llama_state_seq_get_data(ctx, state.data(), state.size(), 0) != state.size()) {
                fprintf(stderr, "error: the state of step %d could not be saved\n", step);
                return 1;
            }
            llama_memory_clear(llama_get_memory(ctx), true);
            if (llama_state_seq_set_data(ctx, state.data(), state.size(), 0) == 0) {
                fprintf(stderr, "error: the state of step %d could not be restored\n", step);
                return 1;
            }
        }

        llama_batch next = llama_batch_get_one(&best, 1);
        if (ok && step + 1 < n_predict) {
            if (llama_decode(ctx, next) != 0) {
                fprintf(stderr, "error: step %d failed to decode\n", step);
                return 1;
            }
            std::memcpy(logits.data(), llama_get_logits_ith(ctx, -1), sizeof(float) * n_vocab);
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
