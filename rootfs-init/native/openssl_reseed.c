/*
 * forkd's Node addon that reseeds OpenSSL's generator in a forked child.
 *
 * Node instantiates OpenSSL's DRBGs when it starts, so every child forked
 * from a warm Node process holds the same DRBG state, and OpenSSL cannot see
 * the fork (its fork check compares pids, which a cloned VM keeps). Node has
 * no API that reseeds it, so evald.js loads this addon and calls
 * `reseed(buffer)` at hand-out: RAND_add() reseeds the primary DRBG from the
 * kernel (which the agent has reseeded by then) with the buffer as additional
 * input, and the per-thread DRBGs reseed from it on their next use because
 * their parent's reseed count changed.
 *
 * Built with -nostdlib and no headers: it uses only Node-API (a stable C ABI)
 * and RAND_add, both resolved at load time from the Node process, so one
 * build works with any glibc and any Node that links OpenSSL 3 dynamically
 * (Debian's does). A Node with OpenSSL linked statically does not export
 * RAND_add and the load fails; evald.js reports that instead of reseeding.
 */
#include <stdbool.h>
#include <stddef.h>

typedef struct napi_env__ *napi_env;
typedef struct napi_value__ *napi_value;
typedef struct napi_callback_info__ *napi_callback_info;
typedef int napi_status; /* napi_ok is 0 */
typedef napi_value (*napi_callback)(napi_env, napi_callback_info);

extern napi_status napi_create_function(napi_env, const char *, size_t,
                                        napi_callback, void *, napi_value *);
extern napi_status napi_set_named_property(napi_env, napi_value, const char *,
                                           napi_value);
extern napi_status napi_get_cb_info(napi_env, napi_callback_info, size_t *,
                                    napi_value *, napi_value *, void **);
extern napi_status napi_get_buffer_info(napi_env, napi_value, void **, size_t *);
extern napi_status napi_get_boolean(napi_env, bool, napi_value *);
extern napi_status napi_throw_type_error(napi_env, const char *, const char *);
extern int RAND_add(const void *, int, double);

#define EXPORT __attribute__((visibility("default")))

/* reseed(buffer) -> true when OpenSSL reseeded; false when it refused. */
static napi_value reseed(napi_env env, napi_callback_info info) {
  size_t argc = 1;
  napi_value arg, result;
  void *data = NULL;
  size_t len = 0;
  if (napi_get_cb_info(env, info, &argc, &arg, NULL, NULL) != 0 || argc < 1 ||
      napi_get_buffer_info(env, arg, &data, &len) != 0 || len == 0 ||
      len > 4096) {
    napi_throw_type_error(env, NULL,
                          "reseed takes a Buffer of 1 to 4096 bytes");
    return NULL;
  }
  bool ok = RAND_add(data, (int)len, (double)len) == 1;
  if (napi_get_boolean(env, ok, &result) != 0)
    return NULL;
  return result;
}

EXPORT napi_value napi_register_module_v1(napi_env env, napi_value exports) {
  napi_value fn;
  if (napi_create_function(env, "reseed", (size_t)-1, reseed, NULL, &fn) != 0 ||
      napi_set_named_property(env, exports, "reseed", fn) != 0)
    return NULL;
  return exports;
}
