// Matrix products of SD 1.5's shapes on ggml's CPU backend (the matrix
// kernels sdhost's CPU plugin runs where there is no AMX: tinyBLAS through
// GGML_LLAMAFILE) against ggml's BLAS backend (OpenBLAS sgemm), in GFLOP/s.
// Issue 17, item 5: whether a BLAS plugin would help. See run.sh.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-blas.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct shape {
    const char * what;
    int k, n, m; // mul_mat(a [k, n], b [k, m]) -> [n, m]
};

// Convolutions are ggml's im2col product (kernel first: a = kernel
// [9 * channels_in, channels_out], b = patches [9 * channels_in, pixels]);
// linear layers a = weight [in, out], b = activations [in, tokens]. Batch
// 2 (CFG) for the UNet.
static const struct shape SHAPES[] = {
    {"UNet conv 3x3 320->320 at 64x64", 2880, 320, 8192},
    {"UNet conv 3x3 640->640 at 32x32", 5760, 640, 2048},
    {"UNet conv 3x3 1280->1280 at 16x16", 11520, 1280, 512},
    {"UNet linear 320->2560 (GEGLU) x8192", 320, 2560, 8192},
    {"UNet linear 1280->320 x8192", 1280, 320, 8192},
    {"VAE conv 3x3 512->512 at 64x64", 4608, 512, 4096},
    {"VAE conv 3x3 256->256 at 256x256", 2304, 256, 65536},
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void fill(struct ggml_tensor * t) {
    int64_t n = ggml_nelements(t);
    float * v = malloc(n * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        v[i] = (float) ((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    }
    if (t->type == GGML_TYPE_F32) {
        ggml_backend_tensor_set(t, v, 0, n * sizeof(float));
    } else {
        size_t sz = ggml_nbytes(t);
        void * q = malloc(sz);
        if (t->type == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(v, q, n);
        } else {
            ggml_fp32_to_bf16_row(v, q, n);
        }
        ggml_backend_tensor_set(t, q, 0, sz);
        free(q);
    }
    free(v);
}

// Best of `runs` seconds for one product on `backend`.
static double time_product(ggml_backend_t backend, ggml_backend_t cpu, enum ggml_type wt,
                           const struct shape * s, int runs) {
    struct ggml_init_params p = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    struct ggml_context * ctx = ggml_init(p);
    struct ggml_tensor * a = ggml_new_tensor_2d(ctx, wt, s->k, s->n);
    struct ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, s->k, s->m);
    struct ggml_tensor * c = ggml_mul_mat(ctx, a, b);
    struct ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, c);
    // Host memory, which both backends compute in.
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, cpu);
    fill(a);
    fill(b);
    double best = 1e30;
    for (int r = 0; r < runs + 1; r++) {
        double t0 = now();
        if (ggml_backend_graph_compute(backend, g) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "compute failed\n");
            exit(1);
        }
        double t = now() - t0;
        if (r > 0 && t < best) best = t; // the first run warms up
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return best;
}

int main(int argc, char ** argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    int runs = argc > 2 ? atoi(argv[2]) : 3;
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, threads);
    ggml_backend_t blas = ggml_backend_blas_init();
    ggml_backend_blas_set_n_threads(blas, threads);
    printf("%d threads, best of %d runs; GFLOP/s (2·k·n·m / time)\n", threads, runs);
    printf("%-40s %10s %10s %10s %10s\n", "product", "cpu f16", "blas f16", "cpu bf16", "blas bf16");
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) {
        const struct shape * s = &SHAPES[i];
        double flop = 2.0 * s->k * s->n * s->m;
        printf("%-40s", s->what);
        enum ggml_type types[2] = {GGML_TYPE_F16, GGML_TYPE_BF16};
        for (int t = 0; t < 2; t++) {
            printf(" %10.1f", flop / time_product(cpu, cpu, types[t], s, runs) / 1e9);
            printf(" %10.1f", flop / time_product(blas, cpu, types[t], s, runs) / 1e9);
            fflush(stdout);
        }
        printf("\n");
    }
    ggml_backend_free(blas);
    ggml_backend_free(cpu);
    return 0;
}
