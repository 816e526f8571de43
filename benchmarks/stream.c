/* STREAM-style memory bandwidth probe, the yardstick for benchmarks/cpu_adam.py.
 *
 * Three kernels over float arrays, first-touch initialisation by the OpenMP threads, work handed out in chunks of
 * 64K elements dynamically (as megazero's CPU Adam does): on cores shared with other jobs a static partition
 * would measure the slowest thread, not the memory system.
 *   copy:  c[i] = a[i]           8 bytes per element
 *   add:   a[i] += b[i]         12 bytes per element (in place, like Adam's p, m, v)
 *   triad: a[i] = b[i] + s*c[i] 12 bytes per element
 * Bytes are counted as STREAM counts them (no write-allocate traffic); each kernel's best time over `reps`.
 *
 * As a program:  cc -O3 -march=native -fopenmp -fno-tree-loop-distribute-patterns stream.c -o stream
 *                ./stream N REPS THREADS     -> one JSON object
 * As a library (-shared -fPIC -DSTREAM_LIBRARY): stream_init(n), stream_measure(reps, threads, out[3]),
 * stream_free(); cpu_adam.py loads it with ctypes to interleave bandwidth probes with the Adam rounds.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHUNK 65536

static float *a, *b, *c;
static long n_elems;

static float* alloc_floats(long n) { return (float*)aligned_alloc(64, ((size_t)n * sizeof(float) + 63) / 64 * 64); }

void stream_free(void) {
  free(a);
  free(b);
  free(c);
  a = b = c = NULL;
}

int stream_init(long n) {
  stream_free();
  n_elems = n;
  a = alloc_floats(n);
  b = alloc_floats(n);
  c = alloc_floats(n);
  if (!a || !b || !c) return 1;
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; ++i) {
    a[i] = 1.0f;
    b[i] = 2.0f;
    c[i] = 0.0f;
  }
  return 0;
}

static double best_of(double best, double t) { return t < best ? t : best; }

/* Best GB/s of copy, add and triad over `reps` runs with `threads` OpenMP threads, into out[0..2]. */
void stream_measure(int reps, int threads, double* out) {
  const long n = n_elems;
  const float s = 1e-7f;
  double t_copy = 1e30, t_add = 1e30, t_triad = 1e30;
  for (int r = 0; r < reps; ++r) {
    double t = omp_get_wtime();
#pragma omp parallel for schedule(dynamic, CHUNK) num_threads(threads)
    for (long i = 0; i < n; ++i) c[i] = a[i];
    t_copy = best_of(t_copy, omp_get_wtime() - t);

    t = omp_get_wtime();
#pragma omp parallel for schedule(dynamic, CHUNK) num_threads(threads)
    for (long i = 0; i < n; ++i) a[i] += b[i];
    t_add = best_of(t_add, omp_get_wtime() - t);

    t = omp_get_wtime();
#pragma omp parallel for schedule(dynamic, CHUNK) num_threads(threads)
    for (long i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    t_triad = best_of(t_triad, omp_get_wtime() - t);
  }
  const double gb = 1e-9 * (double)n * sizeof(float);
  out[0] = 2 * gb / t_copy;
  out[1] = 3 * gb / t_add;
  out[2] = 3 * gb / t_triad;
}

#ifndef STREAM_LIBRARY
int main(int argc, char** argv) {
  const long n = argc > 1 ? atol(argv[1]) : 50000000L;
  const int reps = argc > 2 ? atoi(argv[2]) : 10;
  const int threads = argc > 3 ? atoi(argv[3]) : omp_get_max_threads();
  if (stream_init(n) != 0) {
    fprintf(stderr, "stream: cannot allocate 3 arrays of %ld floats\n", n);
    return 1;
  }
  double gbs[3];
  stream_measure(reps, threads, gbs);
  double best = gbs[0] > gbs[1] ? gbs[0] : gbs[1];
  best = best > gbs[2] ? best : gbs[2];
  printf("{\"threads\": %d, \"n\": %ld, \"reps\": %d, \"copy_gbs\": %.2f, \"add_gbs\": %.2f, \"triad_gbs\": %.2f, "
         "\"best_gbs\": %.2f}\n",
         threads, n, reps, gbs[0], gbs[1], gbs[2], best);
  stream_free();
  return 0;
}
#endif
