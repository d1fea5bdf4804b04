//! Encoder-decoder scheduling (`config.encoder_decoder`): vLLM 0.33's `EncoderDecoderCacheManager` and the
//! encoder-decoder paths of its `_try_schedule_encoder_inputs` and `update_from_output` (learned from reading
//! them). A request's encoder output (`cross_attention_tokens`, the sum of its encoder inputs) is computed in the
//! step that admits it, with nothing computed yet; nothing is cached.
//!
//! - **Admission** (phase B, a request with nothing computed): its encoder tokens must fit what the step's
//!   `max_num_encoder_input_tokens` has left and the slot count; if not, it is skipped (0 tokens, it keeps its
//!   place). Once admitted, both are charged. If its KV allocation then fails, the slot count gets its encoder
//!   tokens back (vLLM frees the request's inputs, allocated or not) and the pass ends.
//! - **Slots back**: at every applied output of a step that scheduled the request (not dropped as stale) while its
//!   computed count is above 0, at its preemption, and at its finish (any reason, waiting or running). So the
//!   count can grow past `encoder_cache_size`, as vLLM's does.
//! - `reset_encoder_decoder_slots` sets the count back to `encoder_cache_size` (vLLM's `reset`, or a new manager).

use crate::error::{Result, SchedError};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// The encoder-decoder slot count (vLLM's `EncoderDecoderCacheManager.num_free_slots`); with
    /// `encoder_decoder` off it stays at `encoder_cache_size`.
    pub fn encoder_decoder_free_slots(&self) -> i64 {
        self.enc_dec_free_slots
    }

    /// Sets the encoder-decoder slot count back to `encoder_cache_size` (vLLM's `EncoderDecoderCacheManager.reset`,
    /// or a new manager on a built scheduler). Refused (`InvalidConfig`) without `encoder_decoder`.
    pub fn reset_encoder_decoder_slots(&mut self) -> Result<()> {
        if !self.config.encoder_decoder {
            return Err(SchedError::InvalidConfig(
                "reset_encoder_decoder_slots needs encoder_decoder=True".into(),
            ));
        }
        self.enc_dec_free_slots = i64::from(self.config.encoder_cache_size);
        self.epoch += 1;
        Ok(())
    }

    /// `add_request`'s checks in encoder-decoder mode: the encoder output comes as `cross_attention_tokens`, not
    /// `encoder_inputs`, and must fit the step's encoder budget (else no step could admit the request).
    pub(crate) fn check_encoder_decoder_request(
        &self,
        req_id: &str,
        num_encoder_inputs: usize,
        cross_attention_tokens: u32,
    ) -> std::result::Result<(), String> {
        if !self.config.encoder_decoder {
            return Ok(());
        }
        if num_encoder_inputs > 0 {
            return Err(format!(
                "request {req_id:?}: with encoder_decoder a request's encoder output is given as \
                 cross_attention_tokens, not encoder_inputs"
            ));
        }
        let budget = self.config.max_num_encoder_input_tokens;
        if cross_attention_tokens > budget {
            return Err(format!(
                "request {req_id:?}: cross_attention_tokens ({cross_attention_tokens}) exceed the encoder compute \
                 budget (max_num_encoder_input_tokens={budget}); no step could admit it"
            ));
        }
        Ok(())
    }

    /// `set_encoder_sizes`' check in encoder-decoder mode: the budget may not drop below a live request's
    /// encoder tokens.
    pub(crate) fn check_encoder_decoder_budget(&self, budget: u32) -> std::result::Result<(), String> {
        if !self.config.encoder_decoder {
            return Ok(());
        }
        match self.slab.iter().filter(|r| r.cross_attention_tokens > budget).max_by_key(|r| r.cross_attention_tokens)
        {
            Some(r) => Err(format!(
                "a live request has {} encoder tokens (cross_attention_tokens), more than a step could compute with \
                 max_num_encoder_input_tokens={budget}",
                r.cross_attention_tokens
            )),
            None => Ok(()),
        }
    }
}
