"""What every request goes through before and around its handler: who may call (`guards`), how
much is admitted (`admission`), the request's span (`tracing_mw`), the error tree every refusal is
rendered from (`errors`), and the records a handler may touch only when the caller owns them
(`ownership`)."""
