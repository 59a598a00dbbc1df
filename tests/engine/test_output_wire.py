"""The engine's outputs on the api <-> engine wire (``jaxserve.proto.engine_convert``)."""

from __future__ import annotations

from jaxserve.engine.messages import EngineCoreOutput, SampleLogprobs
from jaxserve.proto import engine_pb2 as epb
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.engine_convert import add_outputs, output_from_proto

OUTPUTS = [
    EngineCoreOutput("a", 0, [5], None, None, None, 32, 0),  # decoding: defaults everywhere
    EngineCoreOutput("a", 3, [0], None, "stop", 0, 7, 16),  # stop token id 0 is kept
    EngineCoreOutput("b", 1, [9], [SampleLogprobs(-0.5, 2, (4, 9), (-0.25, -0.5))], "length",
                     None, 1, 0),
    EngineCoreOutput("c", 0, [], None, "abort", None, 4, 4),
    EngineCoreOutput("d", 0, [1], [SampleLogprobs(-1.0, 1, (), ())], None, None, 2, 0),
    EngineCoreOutput("e", 0, [3], None, None, None, 3, 0,  # prompt logprobs of tokens 1, 2
                     [SampleLogprobs(-2.0, 5, (1,), (-0.125,)), SampleLogprobs(-0.5, 1, (), ())]),
    EngineCoreOutput("f", 0, [3], None, None, None, 1, 0, []),  # a one-token prompt's
]
FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
          "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def _full_message(o: EngineCoreOutput) -> epb.EngineOutput:
    """Every field set explicitly, defaults included: the oracle for the sparse form."""
    m = epb.EngineOutput(request_id=o.request_id, index=o.index, new_token_ids=o.new_token_ids,
                         finish_reason=FINISH[o.finish_reason],
                         num_prompt_tokens=o.num_prompt_tokens,
                         num_cached_tokens=o.num_cached_tokens,
                         has_logprobs=o.new_logprobs is not None,
                         has_prompt_logprobs=o.prompt_logprobs is not None)
    if o.stop_reason is not None:
        m.stop_reason = o.stop_reason
    for lp in o.new_logprobs or ():
        m.new_logprobs.add(logprob=lp.logprob, rank=lp.rank, top_token_ids=lp.top_token_ids,
                           top_logprobs=lp.top_logprobs)
    for lp in o.prompt_logprobs or ():
        m.prompt_logprobs.add(logprob=lp.logprob, rank=lp.rank, top_token_ids=lp.top_token_ids,
                              top_logprobs=lp.top_logprobs)
    return m


def test_outputs_round_trip_and_match_the_full_messages():
    batch = epb.EngineOutputBatch()
    add_outputs(batch.outputs, OUTPUTS)
    expected = epb.EngineOutputBatch(outputs=[_full_message(o) for o in OUTPUTS])
    assert batch.SerializeToString(deterministic=True) == \
        expected.SerializeToString(deterministic=True)
    wire = epb.EngineOutputBatch.FromString(batch.SerializeToString())
    assert [output_from_proto(m) for m in wire.outputs] == OUTPUTS
